"""Loaded by every Python process the test suite starts (``tests/conftest.py`` puts this folder
on ``PYTHONPATH``). Three changes to third-party start-up, each applied when the module is first
imported, never before:

- vLLM's engine and worker processes poll their shared-memory queue with ``sched_yield`` for
  a second after each message before they sleep on a socket. On a two-core machine running
  two servers, a server that just answered starves the other one's processes for that second
  (a request alternating between two servers took 1 s instead of 50 ms, and start-ups beside
  a busy engine took minutes). The tests shorten the poll to 10 ms; vLLM's behaviour is
  otherwise its own.
- vLLM's CPU platform starts every process it makes with ``spawn``, so an engine-core process
  imports vLLM, torch and transformers again: about 15 s of a 35 s server start-up here. Where
  the engine process runs the model itself (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the suite's
  default, so no worker process is forked from one that has started OpenMP threads), the
  suite's servers start it with ``fork``, as vLLM does on a GPU: from the API server, which has
  imported all of that and run no model. A server with a worker process keeps ``spawn``, and
  so does one whose test sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn``.
- transformers imports scikit-learn (and SciPy's statistics) whenever it is installed, for
  the ROC curve of its own assisted generation, which vLLM never runs: 0.9 s of every vLLM
  process's start-up here, where lm-eval brings scikit-learn into the environment. The
  suite's processes see it as absent from transformers; anything else still imports it."""

from __future__ import annotations

import importlib.abc
import os
import sys
from collections.abc import Callable
from types import ModuleType

BUSY_LOOP_S = 0.01


def _short_poll(module: ModuleType) -> None:
    init = module.SpinCondition.__init__

    def short(self, *args, busy_loop_s: float = 1, **kwargs):
        init(self, *args, busy_loop_s=min(busy_loop_s, BUSY_LOOP_S), **kwargs)

    module.SpinCondition.__init__ = short


def _no_sklearn(module: ModuleType) -> None:
    module.is_sklearn_available = lambda: False


def _fork_engine(module: ModuleType) -> None:
    update = module.CpuPlatform.check_and_update_config.__func__
    chosen = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")  # by the test, before vLLM sets it

    def forked(cls, vllm_config):
        update(cls, vllm_config)
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" and chosen != "spawn":
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    module.CpuPlatform.check_and_update_config = classmethod(forked)


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "vllm.distributed.device_communicators.shm_broadcast": _short_poll,
    "transformers.utils.import_utils": _no_sklearn,
    "vllm.platforms.cpu": _fork_engine,
}


class _Patcher(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patch = PATCHES.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Patcher())
