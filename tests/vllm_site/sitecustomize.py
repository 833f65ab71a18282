"""Loaded by every Python process the test suite starts (``tests/conftest.py`` puts this folder
on ``PYTHONPATH``): vLLM's engine and worker processes poll their shared-memory queue with
``sched_yield`` for a second after each message before they sleep on a socket. On a two-core
machine running two servers, a server that just answered starves the other one's processes
for that second (a request alternating between two servers took 1 s instead of 50 ms, and
start-ups beside a busy engine took minutes). The tests shorten the poll to 10 ms; vLLM's
behaviour is otherwise its own. The patch applies when vLLM imports the module, never before."""

from __future__ import annotations

import importlib.abc
import sys

BUSY_LOOP_S = 0.01
_MODULE = "vllm.distributed.device_communicators.shm_broadcast"


class _ShortPoll(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
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
            init = module.SpinCondition.__init__

            def short(self, *args, busy_loop_s: float = 1, **kwargs):
                init(self, *args, busy_loop_s=min(busy_loop_s, BUSY_LOOP_S), **kwargs)

            module.SpinCondition.__init__ = short

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _ShortPoll())
