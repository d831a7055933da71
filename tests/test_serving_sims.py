"""sharing_sim (parallel sampling, beam search) and caching_sim (prefix caching):
hand-computed cases, invariants, bad arguments."""
import numpy as np
import pytest

from paged_numba import caching_sim, sharing_sim
from paged_numba.caching_sim import Request


def test_parallel_sampling_shares_the_full_prompt_blocks():
    # 4 samples of a 48-token prompt (3 full blocks of 16), 1 output token each:
    # each sample holds 49 tokens = 4 blocks (16 logical); the 3 prompt blocks are
    # shared and each sample has its own 4th block: 3 + 4 = 7 physical
    r = sharing_sim.simulate("parallel", 4, [[48, 1]], num_blocks=32)
    assert (r["mean_logical_blocks"], r["mean_physical_blocks"]) == (16.0, 7.0)
    assert r["saving"] == pytest.approx(1 - 7 / 16) and r["cow_copies"] == 0


def test_one_sequence_per_request_saves_nothing():
    req = sharing_sim.make_requests("alpaca", 30, seed=3)
    for mode in sharing_sim.MODES:
        r = sharing_sim.simulate(mode, 1, req, num_blocks=256)
        assert r["saving"] == 0.0 and r["cow_copies"] == 0


def test_beam_search_keeps_width_beams_and_shares_more_than_sampling():
    req = sharing_sim.make_requests("alpaca", 40, seed=1)
    beam = sharing_sim.simulate("beam", 4, req, num_blocks=4096)      # all at once: no preemption
    sample = sharing_sim.simulate("parallel", 4, req, num_blocks=4096)
    assert beam["preemptions"] == 0 and beam["mean_seqs"] == 4 * beam["mean_running"]
    assert beam["saving"] > sample["saving"] > 0
    private = sharing_sim.simulate("beam", 4, req, num_blocks=4096, share=False)
    assert private["saving"] == 0.0 and private["mean_physical_blocks"] == \
        private["mean_logical_blocks"]


def test_a_tight_pool_preempts_and_still_serves_everything():
    req = sharing_sim.make_requests("alpaca", 60, seed=2)
    r = sharing_sim.simulate("beam", 6, req, num_blocks=200)
    assert r["preemptions"] > 0 and r["window"] == "saturated"
    assert r["mean_physical_blocks"] <= 200


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="greedy"), r"mode must be one of \('parallel', 'beam'\), but got 'greedy'\."),
    (dict(width=0), r"width must be a positive int, but got 0\."),
    (dict(num_blocks=4), r"a request needs up to 7 blocks alone, but num_blocks is 4\."),
])
def test_sharing_bad_arguments(kwargs, message):
    args = {**dict(mode="parallel", width=2, requests=[[40, 1]], num_blocks=16), **kwargs}
    with pytest.raises(ValueError, match=message):
        sharing_sim.simulate(**args)
    with pytest.raises(ValueError, match="dataset must be one of"):
        sharing_sim.make_requests("imdb", 3)


def test_chat_turn_reuses_the_conversation_so_far():
    # turn 0: 20 prompt tokens + 13 answer tokens = 33 -> 2 full blocks, the second
    # one filled by the answer; turn 1's prompt is those 33 + 5 new = 38 tokens:
    # both of its full blocks are cached, so it prefills 38 - 32 = 6 tokens
    first = Request(range(20), range(100, 113))
    second = Request(first.prompt + first.output + [200, 201, 202, 203, 204], [300], after=0)
    r = caching_sim.simulate([first, second], num_blocks=8)
    assert r["hit_rate"] == round(2 / 3, 4)        # lookups: 1 (turn 0) + 2 (turn 1)
    assert r["prefill_tokens"] == 20 + 6
    off = caching_sim.simulate([first, second], num_blocks=8, caching=False)
    assert off["prefill_tokens"] == 20 + 38 and off["hit_rate"] == 0.0


def test_system_prompts_raise_the_batch_and_chat_history_thrashes_a_small_pool():
    reqs = caching_sim.make_trace("system-256", 120, seed=0)
    on = caching_sim.simulate(reqs, 256)
    off = caching_sim.simulate(reqs, 256, caching=False)
    assert on["mean_running"] > 1.5 * off["mean_running"] and on["hit_rate"] > 0.5
    # 33 conversations of up to 2048 tokens on 300 blocks (4800 tokens): the
    # histories of 4 at a time stay cached; of all 33 at once, LRU evicts them first
    chat = caching_sim.make_trace("chat", 120, seed=0, max_len=2048)
    few = caching_sim.simulate(chat, 300, users=4)
    many = caching_sim.simulate(chat, 300, users=64)
    assert few["prefill_saved"] > 2 * many["prefill_saved"] > 0


def test_users_queue_one_conversation_at_a_time():
    chat = caching_sim.make_trace("chat", 30, seed=4)
    one = caching_sim.simulate(chat, 1024, users=1)
    assert one["mean_running"] == pytest.approx(1.0)       # never two requests at once
    assert one["steps"] == sum(len(r.output) for r in chat)


def test_caching_bad_arguments():
    with pytest.raises(ValueError, match=r"trace must be 'system-<length>' or 'chat', but got "
                                         r"'rag'\."):
        caching_sim.make_trace("rag", 3)
    with pytest.raises(ValueError, match=r"system prompt length must be in \[1, 2048\), but got "
                                         r"4000\."):
        caching_sim.make_trace("system-4000", 3)
    with pytest.raises(ValueError, match=r"a request needs 3 blocks alone, but num_blocks is 2\."):
        caching_sim.simulate([Request(range(40), [1])], num_blocks=2)
    assert np.isclose(caching_sim.simulate([], num_blocks=2)["mean_running"], 0.0)
