"""This process's place in a run (rank, world size, device) and its random state."""

import contextlib
import os
import random
import signal
import threading

import numpy as np
import torch
import torch.distributed as dist

DISTRIBUTED_BACKENDS = ("nccl", "gloo", "mpi", "ucc", "xccl")  # torch.distributed.Backend's, less its placeholders


FAILURE_KEY = "vil/failure"  # the store's key of the sentence a process that stopped leaves for the others


class Runtime:
    """This process's place in the run: rank, world size and device (from torchrun's environment). Processes
    talk through ``backend`` on CUDA and through gloo on the CPU."""

    def __init__(self, backend="nccl"):
        named = [part.split(":")[-1].strip().lower() for part in backend.split(",")]  # "cpu:gloo,cuda:nccl" too
        if not all(name in DISTRIBUTED_BACKENDS for name in named):
            raise ValueError(
                f"DISTRIBUTED_BACKEND {backend!r} is not a torch.distributed backend; use one of "
                f"{', '.join(DISTRIBUTED_BACKENDS)} (or one per device, such as 'cpu:gloo,cuda:nccl')."
            )
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.rank = int(os.environ.get("RANK", 0))
        local = int(os.environ.get("LOCAL_RANK", 0))
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        else:
            self.device = torch.device("cpu")
        self.backend = backend if self.device.type == "cuda" else "gloo"
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group(self.backend)
        self.is_main = self.rank == 0

    def sum(self, *values):
        """Sum numbers over all processes."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world > 1:
            dist.all_reduce(t)
        return t.tolist()

    def barrier(self):
        if self.world > 1:
            dist.barrier()

    def gather_to_main(self, value):
        """Every process's ``value``, in rank order, in the main process; None in the others."""
        if self.world == 1:
            return [value]
        values = [None] * self.world if self.is_main else None
        dist.gather_object(value, values, dst=0)
        return values

    def leave_failure(self, error):
        """Leave ``error``'s sentence where the other processes can read it (torchrun's store), before this process
        stops: they then fail in their next collective call, in torch's words, and can say this instead
        (:meth:`failure_left`)."""
        if self.world > 1 and dist.is_initialized():
            dist.distributed_c10d._get_default_store().set(FAILURE_KEY, f"process {self.rank}: {error}")

    def failure_left(self):
        """The sentence a process that stopped left with :meth:`leave_failure`, or None."""
        if self.world == 1 or not dist.is_initialized():
            return None
        store = dist.distributed_c10d._get_default_store()
        return store.get(FAILURE_KEY).decode() if store.check([FAILURE_KEY]) else None

    @contextlib.contextmanager
    def before_stopped(self, action):
        """Within the block, ``action()`` runs in the main process before SIGTERM stops it, which then stops as
        SIGTERM stops it. torchrun stops every process so within its ``--monitor-interval`` (0.1 s) of one failing:
        the main process may not have met the failure in a collective call yet (only with several processes, in
        the main thread, where Python runs signal handlers)."""
        if self.world == 1 or not self.is_main or threading.current_thread() is not threading.main_thread():
            yield
            return

        def stop(signum, frame):
            signal.signal(signum, signal.SIG_DFL)
            try:
                action()
            finally:
                os.kill(os.getpid(), signum)

        previous = signal.signal(signal.SIGTERM, stop)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def in_main(self, action):
        """``action()`` in the main process only (its result there, None in the others), every process waiting for
        it. Its refusal (``ValueError``, ``OSError``) is raised in every process, in its words: the others would
        otherwise fail at their next collective call, in torch's."""
        result, failure = None, None
        if self.is_main:
            try:
                result = action()
            except (ValueError, OSError) as error:
                failure = error
        if self.world > 1:
            said = [str(failure) if failure else None]
            dist.broadcast_object_list(said, src=0)
            if said[0] is not None and not self.is_main:
                raise ValueError(said[0])
        if failure:
            raise failure
        return result


def seed_everything(seed):
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def get_rng_state():
    """torch's, Python's, numpy's (and CUDA's) random state, in tensors and plain types that a checkpoint
    loaded with ``weights_only=True`` can hold."""
    numpy = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(numpy[1].astype(np.int64)), "pos": numpy[2], "gauss": [numpy[3], numpy[4]]},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = state["numpy"]
    np.random.set_state(("MT19937", numpy["keys"].numpy().astype(np.uint32), numpy["pos"], *numpy["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
