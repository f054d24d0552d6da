from splitserve.engine.block_manager import BlockManager
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.scheduler import Scheduler, SchedulerConfig
from splitserve.engine.sequence import Sequence, SeqMode

EOS = 2


def make(num_blocks=8, block_size=4, max_num_seqs=8, max_model_len=64):
    bm = BlockManager(num_blocks)
    return Scheduler(SchedulerConfig(block_size, max_num_seqs, 256, max_model_len), bm, (EOS,)), bm


def seq(rid, n_prompt, max_tokens=8, mode=SeqMode.GENERATE, **kw):
    return Sequence(rid, list(range(10, 10 + n_prompt)), SamplingParams(max_tokens=max_tokens, temperature=0, **kw), mode)


def test_prefill_then_decode_with_continuous_batching():
    s, bm = make()
    s.add(seq("a", 5))
    batch, is_prefill = s.schedule()
    assert is_prefill and [x.request_id for x in batch] == ["a"] and batch[0].block_table == [0, 1]
    s.postprocess(batch, [7])
    s.add(seq("b", 3))  # joins between steps
    batch, is_prefill = s.schedule()
    assert is_prefill and [x.request_id for x in batch] == ["b"]
    s.postprocess(batch, [7])
    batch, is_prefill = s.schedule()
    assert not is_prefill and {x.request_id for x in batch} == {"a", "b"}
    assert all(x.num_new_tokens == 1 for x in batch)


def test_finish_on_eos_stop_token_and_length_frees_blocks():
    s, bm = make()
    a, b, c = seq("a", 3), seq("b", 3, stop_token_ids=(99,)), seq("c", 3, max_tokens=2)
    for x in (a, b, c):
        s.add(x)
    batch, _ = s.schedule()
    assert s.postprocess(batch, [EOS, 99, 5]) == [a, b]
    assert a.finish_reason == "stop" and b.finish_reason == "stop" and a.block_table == []
    batch, _ = s.schedule()
    assert s.postprocess(batch, [5]) == [c] and c.finish_reason == "length"
    assert bm.num_free == bm.num_blocks


def test_prefill_only_keeps_blocks_for_the_caller():
    s, bm = make()
    x = seq("p", 6, mode=SeqMode.PREFILL_ONLY)
    s.add(x)
    batch, _ = s.schedule()
    assert s.postprocess(batch, [7]) == [x]
    assert x.finish_reason is None and len(x.block_table) == 2 and bm.num_free == bm.num_blocks - 2
    assert not s.has_work()


def test_decode_growth_allocates_and_preempts_when_pool_is_full():
    s, bm = make(num_blocks=3, block_size=2)
    a, b = seq("a", 2, max_tokens=20), seq("b", 2, max_tokens=20)
    s.add(a)
    s.add(b)
    batch, _ = s.schedule()
    s.postprocess(batch, [7, 7])  # each now 3 tokens: needs 2 blocks, only 1 free
    batch, is_prefill = s.schedule()
    assert not is_prefill and batch == [a] and list(s.waiting) == [b]
    assert b.block_table == [] and b.num_computed_tokens == 0 and b.output_token_ids == [7]
    bm.check_integrity()


def test_abort_frees_blocks():
    s, bm = make()
    s.add(seq("a", 5))
    batch, _ = s.schedule()
    s.postprocess(batch, [7])
    assert s.abort("a").finish_reason == "abort"
    assert bm.num_free == bm.num_blocks and s.abort("a") is None
