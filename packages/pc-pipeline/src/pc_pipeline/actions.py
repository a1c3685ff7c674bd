"""The actions a pipeline schedule is made of.

An action is ``(stage, kind, microbatch)`` and prints compactly as
``"2F0"`` (stage 2 forward of microbatch 0), ``"1I3"``, ``"0SEND_F5"``.
Communication actions name the stage on the rank that runs them:

- ``SEND_F(s, m)``: send stage ``s``'s output of microbatch ``m`` to the rank
  of stage ``s + 1``; ``RECV_F(s, m)``: receive stage ``s``'s input from the
  rank of stage ``s - 1``.
- ``SEND_B(s, m)``: send the gradient of stage ``s``'s input to the rank of
  stage ``s - 1``; ``RECV_B(s, m)``: receive the gradient of stage ``s``'s
  output from the rank of stage ``s + 1``.

A backward is either whole (``B``) or split, as zero-bubble schedules do,
into the input gradient (``I``, which the previous stage waits for) and the
weight gradient (``W``, which nobody waits for).
"""

from __future__ import annotations

import re
from enum import Enum
from typing import NamedTuple

__all__ = ["Action", "ActionKind"]


class ActionKind(Enum):
    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_send(self) -> bool:
        return self in (ActionKind.SEND_F, ActionKind.SEND_B)

    @property
    def is_recv(self) -> bool:
        return self in (ActionKind.RECV_F, ActionKind.RECV_B)

    @property
    def produces_input_grad(self) -> bool:
        """Whether the previous stage waits for this action."""
        return self in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT)


_COMPUTE = frozenset(
    {
        ActionKind.FORWARD,
        ActionKind.BACKWARD,
        ActionKind.BACKWARD_INPUT,
        ActionKind.BACKWARD_WEIGHT,
    }
)
_PATTERN = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


class Action(NamedTuple):
    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """``Action.parse("2F0") == Action(2, ActionKind.FORWARD, 0)``."""
        match = _PATTERN.match(text.strip())
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}; expected <stage><kind><microbatch> with kind "
                "one of F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B, e.g. '2F0' or '1SEND_B3'."
            )
        stage, kind, microbatch = match.groups()
        return cls(int(stage), ActionKind(kind), int(microbatch))

    def peer_action(self) -> Action:
        """The action on the other side of a send or receive."""
        kind = self.kind
        if kind is ActionKind.SEND_F:
            return Action(self.stage + 1, ActionKind.RECV_F, self.microbatch)
        if kind is ActionKind.RECV_F:
            return Action(self.stage - 1, ActionKind.SEND_F, self.microbatch)
        if kind is ActionKind.SEND_B:
            return Action(self.stage - 1, ActionKind.RECV_B, self.microbatch)
        if kind is ActionKind.RECV_B:
            return Action(self.stage + 1, ActionKind.SEND_B, self.microbatch)
        raise ValueError(f"{self} is a compute action; only sends and receives have peers.")
