"""A request leaves no reference cycles behind: everything it made is freed by reference
counting when it ends. One cycle per request (a self-rearming timer closure did it) kept the
request's task, rewriter and response alive until the cyclic GC ran, ~500 collections per
5 s under load, about 6% of the proxy's CPU (see `make bench`)."""

from __future__ import annotations

import gc
import types

import pytest

from tests.faults.test_upstream import body, call


def _ours(obj: object) -> bool:
    module = getattr(type(obj), "__module__", "") or ""
    if isinstance(obj, types.FunctionType):
        module = obj.__module__ or ""
    elif isinstance(obj, types.CoroutineType):
        module = obj.cr_code.co_filename
    return (module.startswith(("proxy", "middlewares")) or "/proxy/" in module or "/middlewares/" in module) \
        and "simulator" not in module


@pytest.mark.parametrize("script, stream", [
    ({"text": "one two three four five six"}, True),
    ({"text": "one two three four five six", "coalesce": True}, True),
    ({"text": "one two three"}, False),
])
async def test_a_request_leaves_no_cyclic_garbage(sim, make_proxy, script, stream):
    proxy = await make_proxy()
    status, _, _ = await call(proxy, body(script, stream=stream))  # warm: first-use caches
    assert status == 200
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(3):
            status, _, _ = await call(proxy, body(script, stream=stream))
            assert status == 200
        gc.collect()
        leaked = [obj for obj in gc.garbage if _ours(obj)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not leaked, sorted({type(o).__qualname__ for o in leaked})


async def test_what_start_up_built_is_out_of_the_collectors_way(sim, make_proxy):
    """The app, its config, modules and resources are frozen once started (proxy.app
    _freeze_heap): a full collection then walks only what requests left, not the whole heap,
    which under a paced stream cost ~20% of the proxy's instructions (bench.instructions)."""
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    proxy = await make_proxy()
    frozen = gc.get_freeze_count()
    assert frozen > 10_000  # the modules alone hold more
    status, _, _ = await call(proxy, body({"text": "one two"}, stream=False))
    assert status == 200
    assert gc.get_freeze_count() <= frozen  # once, at start, never per request (freed ones leave it)
