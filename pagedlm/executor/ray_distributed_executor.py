"""RayDistributedExecutor: worker actors on a Ray cluster, one or many nodes.

`ray.init` joins the cluster that RAY_ADDRESS names (started with `ray start --head` on one
machine and `ray start --address=HEAD:6379` on the others) or starts a local one. A placement
group holds one bundle (1 CPU) per worker, packed onto as few nodes as possible; each actor is a
RayWorkerWrapper around a Worker, called through `execute_method`, as in the seeds. The ranks
meet over torch.distributed at rank 0's node address.

A dead actor (its process killed, its node lost) makes the call fail with a WorkerFailedError
naming the rank; the executor then kills the other actors and releases the placement group.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

from pagedlm import envs
from pagedlm.config import EngineConfig
from pagedlm.executor.abstract import Executor, WorkerFailedError
from pagedlm.utils import ctrl_c_deferred, run_through_ctrl_c

logger = logging.getLogger(__name__)


# How long a failed call waits for the other ranks' calls, to name a rank that died.
DEATH_WAIT_S = 3.0


def _dead_rank(pending: list, rank_of: dict, timeout: float) -> int | None:
    """The rank of a pending call whose actor died, within timeout; None if none did."""
    import ray
    from ray.exceptions import RayActorError
    deadline = time.monotonic() + timeout
    while pending and (left := deadline - time.monotonic()) > 0:
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError:
                return rank_of[ref]
            except Exception:  # noqa: BLE001 - another rank's own failure: not a death
                pass
    return None


class RayWorkerWrapper:
    """The actor: builds its Worker on first use and runs its methods by name."""

    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int], rank: int) -> None:
        self.config, self.eos_token_ids, self.rank = config, eos_token_ids, rank
        self.worker = None

    def node_address(self) -> tuple[str, int]:
        """This node's IP and a free port on it (rank 0's are the process group's address)."""
        import ray
        from pagedlm.executor.multiproc_executor import get_open_port
        return ray.util.get_node_ip_address(), get_open_port()

    def pid(self) -> int:
        return os.getpid()

    def init_worker(self, distributed_init_method: str) -> None:
        from pagedlm.worker.worker import Worker
        self.worker = Worker(self.config, self.eos_token_ids, rank=self.rank, local_rank=0,
                             distributed_init_method=distributed_init_method)

    def execute_method(self, method: str, *args, **kwargs) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)


class RayDistributedExecutor(Executor):

    def _init_executor(self) -> None:
        self.step_timeout_s = envs.PAGEDLM_ENGINE_ITERATION_TIMEOUT_S
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pc = self.config.parallel_config
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            address = envs.RAY_ADDRESS
            # Ray's daemons (and through them the actors) start with SIGHUP blocked, as Ray
            # blocks SIGINT: a closed terminal signals the whole process group, and with its
            # GCS dead the engine's shutdown waited about 35 s on Ray's timeouts. We stop them.
            # (A thread's signal mask passes to the processes it starts.)
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
            try:
                ray.init(address=address, include_dashboard=False, log_to_driver=False,
                         **({} if address else
                            {"num_cpus": max(pc.world_size, os.cpu_count() or 1)}))
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        self.placement_group = placement_group([{"CPU": 1}] * pc.world_size, strategy="PACK")
        ray.get(self.placement_group.ready(), timeout=120)
        actor_cls = ray.remote(num_cpus=1)(RayWorkerWrapper)
        self.actors = [
            actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=rank)
            ).remote(self.config, self.eos_token_ids, rank)
            for rank in range(pc.world_size)]
        ip, port = ray.get(self.actors[0].node_address.remote())
        self._call_all("init_worker", (f"tcp://{ip}:{port}",))
        logger.info("started %d Ray worker actors (tp=%d, pp=%d)", pc.world_size,
                    pc.tensor_parallel_size, pc.pipeline_parallel_size)

    def _call_all(self, name: str, args: tuple = (), kwargs: dict | None = None,
                  wrapped: bool = False) -> list[Any]:
        import ray
        from ray.exceptions import RayActorError, RayTaskError
        with ctrl_c_deferred():  # all actors get the call, or they wait for each other
            try:
                refs = [(getattr(a, "execute_method").remote(name, *args, **(kwargs or {}))
                         if wrapped else getattr(a, name).remote(*args, **(kwargs or {})))
                        for a in self.actors]
            except KeyboardInterrupt:  # a second Ctrl-C: some actors have it, the others not
                logger.debug("interrupted while sending %r; stopping all workers", name)
                self.shutdown()
                raise
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        # Steps only, as the mp executor's: an actor stopped or stuck in a collective otherwise
        # hung every request for good, with nothing in the log.
        timeout = self.step_timeout_s if name == "execute_model" else None
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                ranks = sorted(rank_of[ref] for ref in pending)
                self._fail(f"worker rank{'s' if len(ranks) > 1 else ''} "
                           f"{', '.join(map(str, ranks))} did not finish {name!r} within "
                           f"{timeout:g} s (PAGEDLM_ENGINE_ITERATION_TIMEOUT_S): stopped, or "
                           f"stuck in a collective")
            rank = rank_of[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except RayActorError as e:
                self._fail(f"worker rank {rank} died during {name!r}: {e}")
            except RayTaskError as e:
                # A rank whose peer died fails in the collective it shared with it ("connection
                # reset by peer"), often before Ray reports the death: name the dead one.
                dead = _dead_rank(pending, rank_of, DEATH_WAIT_S)
                if dead is not None:
                    self._fail(f"worker rank {dead} died during {name!r} (rank {rank} then "
                               f"failed: {str(e).splitlines()[-1][:300]})")
                self._fail(f"worker rank {rank} failed in {name!r}: {e}")
        return results

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None
                       ) -> list[Any]:
        if self.is_shutdown:
            raise WorkerFailedError("the executor's workers have been shut down.")
        return self._call_all(method, args, kwargs, wrapped=True)

    def worker_pids(self) -> list[int]:
        import ray
        return ray.get([a.pid.remote() for a in self.actors])

    def _fail(self, message: str) -> None:
        # Not logged here: the caller gets the error (the engine loop logs it, once).
        logger.debug("%s; stopping all workers", message)
        self.shutdown()
        raise WorkerFailedError(message)

    def shutdown(self) -> None:
        if self.is_shutdown:
            return
        # To its end: a Ctrl-C midway marked it done with the actors, the placement group and
        # Ray still up (a later LLM in the process waited 120 s for their CPUs).
        run_through_ctrl_c(self._release)

    def _release(self) -> None:
        super().shutdown()
        import ray
        if not ray.is_initialized():
            return
        for actor in getattr(self, "actors", []):
            ray.kill(actor)
        if getattr(self, "placement_group", None) is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self.placement_group)
        if getattr(self, "_started_ray", False):
            ray.shutdown()
