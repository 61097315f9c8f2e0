"""Ray: start or join the cluster, decide how many workers it holds, place the worker actors.

Workers are named, detached actors in ``cluster.namespace``: an entry that restarts (or a second
entry) finds the running workers by name instead of starting new ones, so calls survive an entry
restart. Ray restarts a worker whose process dies, up to ``cluster.max_restarts`` times.
"""

from __future__ import annotations

import logging
from typing import Any

from lychee_rtc.cluster.worker import WorkerServer
from lychee_rtc.config import ClusterSettings, Settings

log = logging.getLogger(__name__)

ACTOR_PREFIX = "lychee-rtc-"


class PlacementError(RuntimeError):
    """The cluster cannot hold the workers asked for (no GPU, no worker resource, no Ray)."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise PlacementError("the cluster entry needs Ray: pip install 'lychee-rtc[cluster]'") from exc
    return ray


def connect(cluster: ClusterSettings) -> bool:
    """Join the configured Ray cluster, or start a local one; True when this process started Ray."""
    ray = import_ray()
    common: dict[str, Any] = {"namespace": cluster.namespace, "logging_level": logging.WARNING,
                              "log_to_driver": False}
    if cluster.address is not None:
        ray.init(address=cluster.address, **common)
        return False
    # A single machine: the local Ray holds as many worker slots as asked for ("auto": one, or the GPUs).
    slots = cluster.workers if isinstance(cluster.workers, int) else 1
    resources = {} if cluster.worker_gpus > 0 else {cluster.worker_resource: slots}
    ray.init(resources=resources, include_dashboard=False,
             object_store_memory=cluster.local_object_store_mb * 1024 * 1024, **common)
    return True


def worker_count(cluster: ClusterSettings, resources: dict[str, float]) -> int:
    """How many workers the cluster holds: the configured number, or one per GPU / per slot group."""
    if isinstance(cluster.workers, int):
        return cluster.workers
    if cluster.worker_gpus > 0:
        return int(resources.get("GPU", 0) // cluster.worker_gpus)
    return int(resources.get(cluster.worker_resource, 0))


def no_room_reason(cluster: ClusterSettings, resources: dict[str, float]) -> str:
    if cluster.worker_gpus > 0:
        return f"{cluster.worker_gpus:g} GPU per worker, the cluster has {resources.get('GPU', 0):g} GPUs"
    return (f"no {cluster.worker_resource!r} resource in the cluster (start CPU nodes with "
            f"ray start --resources '{{\"{cluster.worker_resource}\": N}}')")


def actor_options(cluster: ClusterSettings, worker: str) -> dict[str, Any]:
    options: dict[str, Any] = {
        "name": ACTOR_PREFIX + worker,
        "namespace": cluster.namespace,
        "lifetime": "detached",
        "get_if_exists": True,
        "max_restarts": cluster.max_restarts,
        "max_task_retries": 0,  # a status poll or drain is never replayed on a new process
        "num_cpus": cluster.worker_cpus,
        "num_gpus": cluster.worker_gpus,
        "scheduling_strategy": "SPREAD",
    }
    if cluster.worker_gpus == 0:
        options["resources"] = {cluster.worker_resource: 1}
    return options


def worker_settings(settings: Settings) -> str:
    """The profile a worker serves with, as JSON (the entry's own listen address is not the worker's)."""
    data = settings.model_dump(mode="json")
    data["server"]["port"] = 0
    return Settings.model_validate(data).model_dump_json()


def spawn(settings: Settings, workers: list[str]) -> dict[str, Any]:
    """Worker id -> actor handle for ``workers`` (running ones are found by name)."""
    ray = import_ray()
    actor_class = ray.remote(WorkerServer)
    profile = worker_settings(settings)
    return {worker: actor_class.options(**actor_options(settings.cluster, worker)).remote(worker, profile)
            for worker in workers}


def respawn(settings: Settings, worker: str) -> Any:
    """A fresh actor for ``worker`` (after the previous one was killed without restart)."""
    ray = import_ray()
    return ray.remote(WorkerServer).options(**actor_options(settings.cluster, worker)).remote(
        worker, worker_settings(settings))


def is_restarting(exc: BaseException) -> bool:
    """Ray's error for a call to an actor it is restarting (after its process or node was lost)."""
    return isinstance(exc, import_ray().exceptions.ActorUnavailableError)


def kill(handle: Any, restart: bool) -> None:
    import_ray().kill(handle, no_restart=not restart)


def cluster_resources() -> dict[str, float]:
    return dict(import_ray().cluster_resources())


def shutdown() -> None:
    import_ray().shutdown()
