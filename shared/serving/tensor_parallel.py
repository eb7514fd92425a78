"""--tp N: a service's N ranks, one process each, on torch.distributed (NCCL on CUDA, gloo on CPU).

Rank 0 is the service's own process: it serves gRPC, runs the one scheduler thread and the
`LeaderEngine`. `start_ranks` spawns ranks 1..N-1; each loads the model, keeps its share
(`shared/model/tensor_parallel.py`), builds a `FollowerEngine` once rank 0 sends the engine's
configuration (the KV pool is sized on rank 0: every rank must hold the same pages) and then makes
rank 0's engine calls (`shared/engine/mirror.py`).

Supervision: a thread of rank 0 waits on the ranks' processes. A rank that exits while the service
runs has left its peers in, or on their way to, a collective that will never complete: the service
logs which rank died and how, reports NOT_SERVING (liveness too, so that the process is replaced) and
exits with code 4 (`EXIT_RANK_DIED`), taking its other ranks with it. A rank whose rank 0 disappears
(its link closes, or its parent process changes) exits too: no rank outlives its service.

The ranks meet through a file in a private temporary directory (torch's FileStore): no port listens
for the rendezvous; gloo and NCCL connect the ranks over the loopback interface unless
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME say otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shared.engine.engine import EngineConfig
from shared.engine.kv.cache import KVConfig
from shared.engine.mirror import FollowerEngine, Link, follow
from shared.model import LoadedModel
from shared.model.fingerprint import fingerprint
from shared.model.quant import quantize_head, quantize_model, quantized_parameters
from shared.model.tensor_parallel import TensorParallel, check_split, shard
from shared.serving.api.model_source import load_served_model
from shared.serving.config import CommonConfig

__all__ = [
    "EXIT_RANK_DIED", "Ranks", "join_group", "load_whole", "rank_device", "share_of", "start_ranks",
]  # fmt: skip

EXIT_RANK_DIED = 4
_GRACE_S = 1.0  # NOT_SERVING reported, before the process exits: a probe in flight sees it
log = logging.getLogger(__name__)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: the CPU, or the GPU `rank` places after rank 0's."""
    if device.type != "cuda":
        return device
    index = (device.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"tp: rank {rank} needs cuda:{index}, but only {torch.cuda.device_count()} GPU(s) are visible"
        )
    return torch.device("cuda", index)


def join_group(rendezvous: str, rank: int, world: int, device: torch.device) -> TensorParallel:
    """This process as rank `rank` of `world`, met through the file `rendezvous`."""
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(var, "lo")  # the ranks of one host talk over loopback only
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = dist.FileStore(rendezvous, world)
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, **kwargs)
    return TensorParallel(rank, world)


def load_whole(cfg: CommonConfig, device: torch.device) -> LoadedModel:
    """The served model as a whole, unquantized where --quantization quantizes at load (each rank
    quantizes its share instead, as the whole would be), with the whole model's fingerprint (what the
    KV handshake compares, whatever each side's degree). ValueError: it does not split over --tp."""
    online = cfg.quantization in ("fp8", "fp8-block")
    loaded = load_served_model(
        cfg.model, device=device, dtype=cfg.dtype, quantization="none" if online else cfg.quantization
    )
    if loaded.model.quantization != "none":
        raise ValueError(
            f"tp: a checkpoint quantized to {loaded.model.quantization} is not split over ranks; "
            "serve it with --quantization none (dequantized) or --tp 1"
        )
    check_split(loaded.config, cfg.tp, cfg.expert_parallel)
    if cfg.quantize_lm_head and not online:
        raise ValueError(
            "--quantize-lm-head with --tp quantizes each rank's share at load: it needs --quantization fp8 "
            "or fp8-block"
        )
    # The fingerprint of the model as one rank would serve it (quantized), so that services of other
    # degrees, or of one rank, agree on it.
    head = cfg.quantize_lm_head
    served = (
        (cfg.quantization, quantized_parameters(loaded.model, cfg.quantization, lm_head=head))
        if online
        else None
    )
    return dataclasses.replace(loaded, fingerprint=fingerprint(loaded.model, loaded.tokenizer, served=served))


def share_of(loaded: LoadedModel, cfg: CommonConfig, tp: TensorParallel) -> LoadedModel:
    """`loaded` with this rank's share of its model in place of the whole."""
    local = shard(loaded.model, tp, cfg.expert_parallel)
    if cfg.quantization in ("fp8", "fp8-block"):
        quantize_model(local, cfg.quantization)
        if cfg.quantize_lm_head:  # this rank's block of the vocabulary
            quantize_head(local)
    local.gemm_backend = cfg.gemm
    return dataclasses.replace(loaded, model=local)


@dataclasses.dataclass
class Ranks:
    """Ranks 1..N-1 of a service: their processes and rank 0's end of each one's link."""

    world: int
    rendezvous: str
    processes: list[mp.process.BaseProcess]
    links: list[Link]
    _stopping: bool = False
    on_death: Callable[[str], None] | None = None  # rank 0's service: NOT_SERVING, before the exit

    def send_engine(self, kv: KVConfig, engine_cfg: EngineConfig) -> None:
        """The engine every rank builds (the pool sized on rank 0)."""
        for link in self.links:
            link.send(("engine", kv, engine_cfg))

    def watch(self) -> None:
        """Start the thread that stops the service when a rank exits."""
        threading.Thread(target=self._watch, name="tp-ranks", daemon=True).start()

    def _watch(self) -> None:
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.processes, start=1)}
        ready = mpc.wait(list(sentinels))
        if self._stopping:
            return
        rank, process = sentinels[ready[0]]  # type: ignore[index]
        process.join(1.0)
        code = process.exitcode or 0
        why = f"exit code {code}" if code >= 0 else f"killed by signal {-code}"
        message = f"tensor parallel rank {rank} of {self.world} (pid {process.pid}) died ({why})"
        log.critical("%s: the service stops", message)
        if self.on_death is not None:
            with contextlib.suppress(Exception):
                self.on_death(message)
            time.sleep(_GRACE_S)
        self._kill()
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        sys.stderr.flush()
        os._exit(EXIT_RANK_DIED)  # rank 0's threads may be inside a collective that never returns

    def stop(self, timeout: float = 10.0) -> None:
        """Tell the ranks to stop and wait for them (the service's shutdown)."""
        self._stopping = True
        for link in self.links:
            with contextlib.suppress(OSError):
                link.send(("stop",))
        deadline = time.monotonic() + timeout
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill()
        shutil.rmtree(os.path.dirname(self.rendezvous), ignore_errors=True)

    def _kill(self) -> None:
        self._stopping = True
        for p in self.processes:
            if p.is_alive():
                p.kill()


def start_ranks(cfg: CommonConfig, role: str, device: torch.device) -> Ranks:
    """Spawn ranks 1..cfg.tp-1 of a service whose rank 0 runs on `device` (they start loading at
    once) and watch them."""
    ctx = mp.get_context("spawn")  # a fresh interpreter: no inherited threads, CUDA or locks
    rendezvous = os.path.join(tempfile.mkdtemp(prefix="pdserve-tp-"), "rendezvous")
    processes, links = [], []
    for rank in range(1, cfg.tp):
        ours, theirs = ctx.Pipe(duplex=True)
        p = ctx.Process(
            target=_rank_main,
            args=(cfg, role, rank, rank_device(device, rank), rendezvous, theirs, os.getpid()),
            name=f"pdserve-{role}-rank{rank}", daemon=True,
        )  # fmt: skip
        p.start()
        theirs.close()
        processes.append(p)
        links.append(ours)
    ranks = Ranks(cfg.tp, rendezvous, processes, links)
    ranks.watch()
    return ranks


def _watch_parent(parent: int) -> None:
    """Exit when rank 0's process is gone (a rank blocked in a collective would never notice)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(EXIT_RANK_DIED)

    threading.Thread(target=watch, name="tp-parent", daemon=True).start()


def _rank_main(
    cfg: CommonConfig, role: str, rank: int, device: torch.device, rendezvous: str, link: Link, parent: int
) -> None:  # fmt: skip
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s {role} rank {rank} %(name)s: %(message)s")
    _watch_parent(parent)
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        tp = join_group(rendezvous, rank, cfg.tp, device)
        loaded = share_of(load_whole(cfg, device), cfg, tp)
        kind, kv, engine_cfg = link.recv()
        assert kind == "engine", kind
        kv = dataclasses.replace(kv, device=str(device))
        engine = FollowerEngine(loaded.model, kv, engine_cfg, link=link)
        follow(engine)
    except EOFError:  # rank 0 closed its end: the service is gone
        os._exit(0)
    except BaseException:
        logging.getLogger(f"{role}_service").exception("tensor parallel rank %d failed", rank)
        logging.shutdown()
        os._exit(1)
    dist.destroy_process_group()
