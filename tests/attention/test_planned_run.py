"""A planned wrapper's kernel call kept from its first run (attention/planned_run.py), without a GPU: FlashInfer's
paged wrapper is replaced by one that, like it, derives its kernel's arguments from its plan at every run and calls
its compiled module's `paged_run` with them (the real kernels: tests/gpu/test_flashinfer_backend.py)."""

import types

import torch

from attention.planned_run import PlannedRun


def kernel(workspace, plan, q, k_cache, v_cache, indptr, out, lse, scale):
    """Writes what the real kernel's caller could check: a function of the query, both caches and the plan."""
    out.copy_(q * scale + k_cache.float().sum() - 2 * v_cache.float().sum() + plan[0] + indptr.sum())


class KernelWrapper:
    """Calls its module's kernel once per run, with positional arguments derived from the plan (as FlashInfer's)."""

    def __init__(self, kernel_calls: int = 1, keyword: bool = False, other_output: bool = False):
        self.runs = 0
        self.kernel_calls, self.keyword, self.other_output = kernel_calls, keyword, other_output
        self.kernel_seen = 0

        def paged_run(*args, **kwargs):
            self.kernel_seen += 1
            kernel(*args, **kwargs)

        self._cached_module = types.SimpleNamespace(paged_run=paged_run, plan=None)

    def plan(self, offset: float):
        self.plan_info, self.indptr, self.workspace = [offset], torch.arange(3), torch.zeros(4)

    def run(self, q, kv, out=None):
        self.runs += 1
        k, v = kv.unbind(1)
        args = [self.workspace, self.plan_info, q, k, v, self.indptr, out, None, 0.5]
        for _ in range(self.kernel_calls):
            if self.keyword:
                self._cached_module.paged_run(*args[:-1], scale=args[-1])
            else:
                self._cached_module.paged_run(*args)
        return out.clone() if self.other_output else out


def layers(n: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(3, 2, 4, 2, 8, generator=generator) for _ in range(n)]


def test_later_layers_call_the_kernel_with_their_own_query_cache_and_output():
    reference, wrapper = KernelWrapper(), KernelWrapper()
    for w in (reference, wrapper):
        w.plan(3.0)
    caches = layers(4)
    queries = [torch.randn(5, 4, 8) for _ in caches]
    expected = [reference.run(q, kv, out=torch.empty_like(q)).clone() for q, kv in zip(queries, caches)]
    outs = [torch.empty_like(q) for q in queries]
    first, planned = PlannedRun.record(wrapper, queries[0], caches[0], outs[0])
    assert planned is not None and first is outs[0]
    results = [first] + [planned(q, kv, out) for q, kv, out in zip(queries[1:], caches[1:], outs[1:])]
    assert wrapper.runs == 1 and wrapper.kernel_seen == 4  # one run, watched; three direct kernel calls
    for result, out, want in zip(results, outs, expected):
        assert result is out and torch.equal(out, want)
    # the wrapper's module is its own again after the watched run
    assert isinstance(wrapper._cached_module, types.SimpleNamespace)


def test_a_query_of_another_shape_goes_through_run():
    wrapper = KernelWrapper()
    wrapper.plan(1.0)
    kv = layers(1)[0]
    _, planned = PlannedRun.record(wrapper, torch.randn(5, 4, 8), kv, torch.empty(5, 4, 8))
    q = torch.randn(6, 4, 8)
    out = planned(q, kv, torch.empty_like(q))
    assert wrapper.runs == 2 and torch.equal(out, KernelWrapper.run(wrapper, q, kv, out=torch.empty_like(q)))


def test_no_call_is_kept_where_the_watched_run_is_not_one_plain_kernel_call():
    q, kv = torch.randn(5, 4, 8), layers(1)[0]
    for wrapper in (KernelWrapper(kernel_calls=2), KernelWrapper(kernel_calls=0), KernelWrapper(keyword=True),
                    KernelWrapper(other_output=True)):
        wrapper.plan(1.0)
        out, planned = PlannedRun.record(wrapper, q, kv, torch.empty_like(q))
        assert planned is None and wrapper.runs == 1
    bare = types.SimpleNamespace(run=lambda q, kv, out=None: out.fill_(7.0))  # no compiled module to watch
    out, planned = PlannedRun.record(bare, q, kv, torch.empty_like(q))
    assert planned is None and bool((out == 7.0).all())


def test_no_call_is_kept_where_the_query_also_stands_for_another_argument():
    """The query passed twice (or the cache's halves): which one is the query would be a guess."""
    wrapper = KernelWrapper()
    wrapper.plan(1.0)
    q, kv = torch.randn(5, 4, 8), layers(1)[0]
    wrapper.workspace = q  # the same tensor in a second place
    _, planned = PlannedRun.record(wrapper, q, kv, torch.empty_like(q))
    assert planned is None
