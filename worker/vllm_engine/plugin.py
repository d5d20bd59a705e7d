"""A vLLM general plugin (entry point ``vllm.general_plugins``): vLLM loads it in each of its processes where Baton
is installed. It changes nothing unless ``BATON_VLLM_NIXL_PROGRESS_DELAY_US`` is set.

Why: NIXL 1.5's Python API starts each agent's progress thread with no pause between polls (``pthrDelay`` fixed
at 0), so every vLLM worker with NixlConnector spins one core whether or not a transfer runs (measured: 100% of a
core per idle vLLM worker process, in ``nixlUcxSharedThread::run``). On a machine with few cores per worker that
starves the model's own threads. The thread cannot simply go: an idle prefill engine does not step, so nothing
else would progress its agent while a decoder reads its blocks or notifies it (tried: the second pull of a pair
then hung until the request's deadline). With the variable set, the thread is kept and pauses that many
microseconds between polls. Baton's vLLM workers set it (``worker.vllm_engine.engine``); the benchmark's vLLM
peers are measured with and without it.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)
ENV = "BATON_VLLM_NIXL_PROGRESS_DELAY_US"


class _Bindings:
    """NIXL's binding module, except that each agent's progress thread pauses ``delay_us`` between polls."""

    def __init__(self, bindings, delay_us: int) -> None:
        self._bindings, self._delay_us = bindings, delay_us

    def __getattr__(self, name: str):
        return getattr(self._bindings, name)

    def nixlAgent(self, name, config):  # NIXL's name
        config.pthrDelay = self._delay_us
        return self._bindings.nixlAgent(name, config)


def register() -> None:
    delay = os.environ.get(ENV)
    if not delay:
        return
    # what vLLM sets before it imports NIXL (a UCX registration-cache leak); importing NIXL here would stop it
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    try:
        from nixl import _api
    except ImportError:  # no NIXL here: nothing to change
        return
    if not isinstance(_api.nixlBind, _Bindings):
        _api.nixlBind = _Bindings(_api.nixlBind, int(delay))
        logger.info("NIXL agents' progress threads pause %s us between polls (%s)", delay, ENV)
