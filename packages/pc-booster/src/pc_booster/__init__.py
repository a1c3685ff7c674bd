"""pc-booster: the meta-package of pc. Installing it brings every layer.

Status: the ``Booster`` and its plugins arrive with issue 10. Today the
package provides the ``pc-train`` command (:mod:`pc_booster.train`): a small
GPT-2 trained data-parallel over pc-comm.
"""

from pc_booster.train import TrainConfig, load_byte_corpus, train

__all__ = ["TrainConfig", "load_byte_corpus", "train"]
