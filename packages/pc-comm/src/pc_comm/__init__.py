"""pc-comm: process groups and topology, the Communicator protocol and its
torch.distributed implementation, and collectives built on it.

The multi-process test harness lives in :mod:`pc_comm.testing`; which rank
failed and where, in :mod:`pc_comm.health`.
"""

from pc_comm import (
    _exit,  # noqa: F401  [Note: threads at interpreter exit]
    health,
)
from pc_comm.collectives import all_reduce_coalesced
from pc_comm.communicator import (
    AllToAll,
    Communicator,
    CompletedHandle,
    Handle,
    P2PKind,
    P2POp,
    ReduceOp,
    SymmetricAllocator,
)
from pc_comm.ddp import DistributedDataParallel, default_communicator, on_one_host
from pc_comm.env import DistEnv, DistEnvError, read_dist_env
from pc_comm.health import PeerFailureError, set_phase
from pc_comm.hierarchical import HierarchicalCommunicator
from pc_comm.hooks import weak_method
from pc_comm.host_allocator import RETURN_FREED, HostAllocatorSettings, tune_host_allocator
from pc_comm.launch import DistContext, StoreUnreachableError, init_distributed
from pc_comm.shm import ShmCommunicator, ShmPeerError, ShmSpaceError, usable_cores
from pc_comm.topology import Coord, ParallelDims, Subgroups, make_subgroups, two_level_groups
from pc_comm.torch_communicator import TorchCommunicator

__version__ = "0.1.0"

__all__ = [
    "RETURN_FREED",
    "AllToAll",
    "Communicator",
    "CompletedHandle",
    "Coord",
    "DistContext",
    "DistEnv",
    "DistEnvError",
    "DistributedDataParallel",
    "Handle",
    "HierarchicalCommunicator",
    "HostAllocatorSettings",
    "P2PKind",
    "P2POp",
    "ParallelDims",
    "PeerFailureError",
    "ReduceOp",
    "ShmCommunicator",
    "ShmPeerError",
    "ShmSpaceError",
    "StoreUnreachableError",
    "Subgroups",
    "SymmetricAllocator",
    "TorchCommunicator",
    "all_reduce_coalesced",
    "default_communicator",
    "health",
    "init_distributed",
    "make_subgroups",
    "on_one_host",
    "read_dist_env",
    "set_phase",
    "tune_host_allocator",
    "two_level_groups",
    "usable_cores",
    "weak_method",
]
