"""A request's commits: several tokens at once end the request exactly where committing them one by one does."""

from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.engine.request import Request
from specdec.engine.sampling_params import SamplingParams

EOS = frozenset({2, 5})


def one_by_one(request: Request, tokens: list[int]) -> int:
    """The reference: `commit` per token until one finishes the request."""
    for n, token in enumerate(tokens, start=1):
        if request.commit(token):
            return n
    return len(tokens)


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 8), max_size=12), earlier=st.lists(st.integers(6, 8), max_size=6),
       max_new=st.integers(1, 10), prompt_len=st.integers(1, 6), total=st.one_of(st.none(), st.integers(2, 16)),
       ignore_eos=st.booleans())
def test_committing_at_once_equals_committing_one_by_one(tokens, earlier, max_new, prompt_len, total, ignore_eos):
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos)
    bulk, single = (Request(i, [1] * prompt_len, params, EOS, output_ids=list(earlier), max_total_tokens=total)
                    for i in range(2))
    taken = bulk.commit_many(tokens)
    assert taken == one_by_one(single, tokens)
    assert bulk.output_ids == single.output_ids
    assert (bulk.status, bulk.finish_reason) == (single.status, single.finish_reason)
    assert bulk.stats.generated_tokens == single.stats.generated_tokens
    assert (bulk.stats.first_token_time is None) == (single.stats.first_token_time is None)
