"""Multi-process runs on jax.distributed: process 0 schedules, every process runs each step.

Process 0's runner sends every step's host inputs (a fixed-size header with the arrays'
shapes, then the arrays) with multihost_utils.broadcast_one_to_all; the other processes
sit in ModelRunner.follow(), receive them and launch the same jitted step, so all
processes issue the same collectives in the same order. Inputs become replicated global
arrays over the TP mesh (a process supplies its own devices' copies).
"""
from __future__ import annotations

import argparse

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from nanojax.errors import ConfigError

_DTYPES = (np.int32, np.uint32, np.float32, np.int64, np.bool_)
_MAX_LEAVES, _MAX_DIMS = 32, 3


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                   help="jax.distributed coordinator (process 0's address); with "
                        "--num-processes > 1, the TP mesh spans every process's devices")
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0)


def init_distributed(args) -> None:
    """jax.distributed.initialize from the CLI options (before JAX touches a device)."""
    n = getattr(args, "num_processes", 1) or 1
    if n == 1:
        return
    if not args.coordinator_address:
        raise ConfigError("--num-processes > 1 needs --coordinator-address HOST:PORT")
    if not 0 <= args.process_id < n:
        raise ConfigError(f"--process-id must be in [0, {n}), got {args.process_id}")
    # CPU collectives across processes (the GPU uses NCCL and ignores this)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator_address, n, args.process_id)


def is_leader() -> bool:
    return jax.process_index() == 0


def agree(value: int) -> int:
    """Process 0's value on every process (e.g. the KV page count sized from free memory)."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils
    return int(multihost_utils.broadcast_one_to_all(np.int64(value)))


class StepBroadcast:
    """The step inputs' channel from process 0 to the others, and their placement."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.replicated = NamedSharding(mesh, P())

    def place(self, tree):
        """Host arrays -> replicated global arrays over the mesh."""
        def one(x):
            x = np.asarray(x)
            return jax.make_array_from_callback(x.shape, self.replicated, lambda i: x[i])
        return jax.tree_util.tree_map(one, tree)

    def _exchange(self, header: np.ndarray, leaves: list):
        from jax.experimental import multihost_utils
        header = np.asarray(multihost_utils.broadcast_one_to_all(header))
        if header[0]:
            return header, None
        n = int(header[1])
        if not leaves:  # a follower: buffers of the leader's shapes
            for j in range(n):
                code, ndim, *dims = header[2 + j * 5: 7 + j * 5]
                leaves.append(np.zeros(dims[:ndim], _DTYPES[code]))
        got = multihost_utils.broadcast_one_to_all(leaves)
        return header, [np.asarray(x) for x in got]

    def send(self, tree):
        """Process 0: the step's host inputs to every process."""
        leaves, _ = jax.tree_util.tree_flatten(tree)
        if len(leaves) > _MAX_LEAVES:
            raise ValueError("too many step inputs for the broadcast header")
        header = np.zeros(2 + 5 * _MAX_LEAVES, np.int64)
        header[1] = len(leaves)
        for j, x in enumerate(leaves):
            x = np.asarray(x)
            code = next(i for i, d in enumerate(_DTYPES) if x.dtype == d)
            header[2 + j * 5: 4 + j * 5] = code, x.ndim
            header[4 + j * 5: 4 + j * 5 + x.ndim] = x.shape
        self._exchange(header, [np.asarray(x) for x in leaves])

    def stop(self):
        """Process 0: ends the followers' loops."""
        header = np.zeros(2 + 5 * _MAX_LEAVES, np.int64)
        header[0] = 1
        self._exchange(header, [])

    def receive(self, treedefs: dict):
        """Other processes: the next step's inputs, or None when process 0 stopped.
        treedefs: leaf count -> the inputs' structure (a step with or without the
        logit-processing inputs; the header says how many leaves came)."""
        header, leaves = self._exchange(np.zeros(2 + 5 * _MAX_LEAVES, np.int64), [])
        if leaves is None:
            return None
        if len(leaves) not in treedefs:
            raise ValueError(f"step inputs of {len(leaves)} arrays: no known structure")
        return jax.tree_util.tree_unflatten(treedefs[len(leaves)], leaves)


def step_broadcast(forward) -> StepBroadcast | None:
    """The channel when this run spans several processes (which needs the TP mesh to span
    them too), else None."""
    if jax.process_count() == 1:
        return None
    mesh = forward.mesh
    if mesh is None or mesh.devices.size != jax.device_count():
        raise ConfigError(f"a run over {jax.process_count()} processes needs "
                          f"tensor_parallel_size = the global device count "
                          f"({jax.device_count()})")
    return StepBroadcast(mesh)
