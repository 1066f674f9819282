"""prefix-cache-scorer's C inner loops (`extproc/scheduling/_prefix.c`) against their Python reference:
the same block keys, the same leading-run count, the same LRU contents and order after a pick; bad
arguments are refused with TypeError/ValueError. And the scorer gives the same scores either way."""

from __future__ import annotations

import shutil
import zlib
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import extproc.scheduling.prefix_cache_scorer as pcs

native = pcs._native
needs_native = pytest.mark.skipif(native is None, reason="the C accelerator extproc.scheduling._prefix is not "
                                  "built (no C compiler or zlib headers at install): the Python code runs")


def test_setup_builds_the_accelerator_where_a_compiler_is():
    # `make setup` (pip install -e) builds it with setup.py; a silent build failure would leave
    # every deployment here on the slower Python loops
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine: the accelerator cannot be built")
    assert native is not None, "extproc.scheduling._prefix is missing: run `make setup` (setup.py build_ext)"


@needs_native
@settings(max_examples=200, deadline=None, derandomize=True)
@given(model=st.text(max_size=8), data=st.binary(max_size=600), bs=st.integers(1, 64), mx=st.integers(0, 40))
def test_block_keys_equal_the_python_reference(model, data, bs, mx):
    seed = zlib.crc32(model.encode())
    assert native.block_keys(seed, data, bs, mx) == pcs.block_hashes_py(model, data, bs, mx)
    assert pcs.block_hashes(model, data, bs, mx) == pcs.block_hashes_py(model, data, bs, mx)


@needs_native
def test_block_keys_take_any_buffer_and_refuse_bad_arguments():
    seed = zlib.crc32(b"m")
    data = b"abcdefghij"
    assert native.block_keys(seed, memoryview(data), 4, 9) == native.block_keys(seed, bytearray(data), 4, 9)
    assert native.block_keys(seed, data, 4, 9) == pcs.block_hashes_py("m", data, 4, 9)
    with pytest.raises(ValueError):
        native.block_keys(seed, data, 0, 9)
    with pytest.raises(ValueError):
        native.block_keys(seed, data, 4, -1)
    with pytest.raises(TypeError):
        native.block_keys(seed, "not bytes", 4, 9)
    with pytest.raises(TypeError):
        native.block_keys(seed, data, 4)


def _index(keys: list[int], held: int, extra: list[int]) -> OrderedDict:
    lru: OrderedDict = OrderedDict()
    for k in extra:
        lru[k] = None
    for k in keys[:held]:
        lru[k] = None
    return lru


@needs_native
@settings(max_examples=200, deadline=None, derandomize=True)
@given(n=st.integers(0, 50), held=st.integers(0, 50), extra=st.lists(st.integers(0, 2**32 - 1), max_size=20))  # keys are >= 2**32
def test_matched_equals_the_python_reference(n, held, extra):
    keys = pcs.block_hashes_py("m", bytes(range(256)) * 2, 10, n)
    lru = _index(keys, min(held, len(keys)), extra)
    assert native.matched(lru, keys) == pcs.matched_py(lru, keys) == min(held, len(keys))


@needs_native
def test_matched_refuses_what_is_not_a_dict_and_a_list():
    with pytest.raises(TypeError):
        native.matched([], [1])
    with pytest.raises(TypeError):
        native.matched({}, (1,))
    assert native.matched({}, [1, 2]) == 0 and native.matched({1: None}, []) == 0


@needs_native
@settings(max_examples=200, deadline=None, derandomize=True)
@given(before=st.lists(st.integers(0, 60), max_size=40, unique=True),
       picked=st.lists(st.integers(0, 60), max_size=40, unique=True), cap=st.integers(1, 50))
def test_record_leaves_the_same_lru_as_the_python_reference(before, picked, cap):
    a: OrderedDict = OrderedDict.fromkeys(before)
    b: OrderedDict = OrderedDict.fromkeys(before)
    native.record(a, list(picked), cap)
    pcs.record_py(b, list(picked), cap)
    assert list(a.items()) == list(b.items())
    assert len(a) <= cap


@needs_native
def test_record_refuses_bad_arguments():
    with pytest.raises(TypeError):
        native.record(OrderedDict(), (1,), 4)
    with pytest.raises(TypeError):
        native.record(OrderedDict(), [1], "4")


@pytest.mark.parametrize("impl", ["native", "python"])
def test_the_scorer_gives_the_same_scores_and_index_either_way(impl, monkeypatch):
    from types import SimpleNamespace

    from extproc.request import parse_openai
    from extproc.runtime import Runtime

    if impl == "native" and native is None:
        pytest.skip("the C accelerator is not built")
    if impl == "python":
        monkeypatch.setattr(pcs, "_native", None)
    scorer = pcs.PrefixCacheScorer("prefix", pcs.PrefixCacheScorerParameters(blockSize=8, lruCapacityPerServer=20),
                                   Runtime())

    def decide(text: str, pick: str) -> dict[str, float]:
        req = parse_openai("/v1/completions", {"model": "m", "prompt": text})
        ctx = SimpleNamespace(request=req, cycle={})
        out = scorer.score(ctx, ("a", "b"))
        scorer.picked(ctx, pick)
        return out

    system = "s" * 64
    assert decide(system + "q1" * 8, "a") == {"a": 0.0, "b": 0.0}
    assert decide(system + "q2" * 8, "b") == {"a": 0.8, "b": 0.0}  # 8 of 10 blocks are the shared system part
    assert decide(system + "q3" * 8, "a") == {"a": 0.8, "b": 0.8}
    assert all(len(lru) <= 20 for lru in scorer.index.values())
    expected = pcs.block_hashes_py("m", (system + "q3" * 8).encode(), 8, 256)
    assert list(scorer.index["a"])[-10:] == expected[::-1]  # deepest first, so the first block is newest
