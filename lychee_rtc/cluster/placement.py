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
    # "local": a Ray of the entry's own even where `ray start` ran on this machine before (Ray would
    # otherwise join that one, and refuse the resources given here).
    slots = cluster.workers if isinstance(cluster.workers, int) else 1
    resources = {} if cluster.worker_gpus > 0 else {cluster.worker_resource: slots}
    ray.init(address="local", resources=resources, include_dashboard=False,
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


def worker_needs(cluster: ClusterSettings) -> dict[str, float]:
    """The resources one worker takes on its node."""
    needs = {"GPU": cluster.worker_gpus} if cluster.worker_gpus > 0 else {cluster.worker_resource: 1.0}
    if cluster.worker_cpus > 0:
        needs["CPU"] = cluster.worker_cpus
    return needs


def waiting_reason(cluster: ClusterSettings, nodes: list[dict[str, float]], available: dict[str, float]) -> str | None:
    """Why a worker waits for a node, given each live node's total resources and what the cluster
    has free; None when there is room and Ray is about to place it."""
    needs = worker_needs(cluster)
    if any(all(node.get(name, 0) >= amount for name, amount in needs.items()) for node in nodes):
        if all(available.get(name, 0) >= amount for name, amount in needs.items()):
            return None
        taken = "GPUs" if cluster.worker_gpus > 0 else f"{cluster.worker_resource!r} units"
        return (f"waiting for room: every node that fits a worker has its {taken} taken by other workers "
                f"(add nodes, or lower cluster.workers)")
    if cluster.worker_gpus > 0:
        if not any(node.get("GPU", 0) >= cluster.worker_gpus for node in nodes):
            return f"no node has {cluster.worker_gpus:g} GPU for a worker (cluster.worker_gpus)"
    elif not any(node.get(cluster.worker_resource, 0) >= 1 for node in nodes):
        return (f"no node offers the resource {cluster.worker_resource!r}; start Ray on every CPU node with "
                f"ray start ... --resources '{{\"{cluster.worker_resource}\": N}}' (N: workers on that node)")
    return (f"no node has {needs.get('CPU', 0):g} CPUs besides a worker slot (cluster.worker_cpus; "
            f"0 lets workers share the node's CPUs)")


def unplaced_reason(cluster: ClusterSettings, handle: Any) -> str | None:
    """Why Ray has found no node for a worker's actor yet; None once it has one (or if Ray cannot say)."""
    ray = import_ray()
    try:
        # The actor table of Ray's control store: the public state API (ray.util.state) needs the
        # dashboard, which clusters here run without.
        from ray._private import state

        info = state.actors(actor_id=handle._actor_id.hex())
    except Exception:
        return None
    if info.get("State") not in ("DEPENDENCIES_UNREADY", "PENDING_CREATION") or info.get("Pid"):
        return None
    if (info.get("Address") or {}).get("IPAddress"):
        return None  # on a node, its constructor running (an engine loading its checkpoint)
    nodes = [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]
    return waiting_reason(cluster, nodes, dict(ray.available_resources()))


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


def is_restarting(exc: BaseException) -> bool:
    """Ray's error for a call to an actor it is restarting (after its process or node was lost)."""
    return isinstance(exc, import_ray().exceptions.ActorUnavailableError)


def kill(handle: Any, restart: bool) -> None:
    import_ray().kill(handle, no_restart=not restart)


def cluster_resources() -> dict[str, float]:
    return dict(import_ray().cluster_resources())


def shutdown() -> None:
    import_ray().shutdown()
