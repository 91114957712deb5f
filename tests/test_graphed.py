"""The one-row no-grad log-prob passes replayed from CUDA graphs ([`core.forward.graphed`]), capture emulated on CPU:
stock TRL's numbers in float64, the replays engaged, and a replay that differs caught at first use."""

import contextlib
import warnings

import pytest
import torch
import trl

from rloo_efficient import RLOOTrainer
from rloo_efficient.core import graphs as core_graphs
from rloo_efficient.core.forward import graphed
from rloo_efficient.core.forward.packing import pack_rows
from rloo_efficient.core.once import WarnOnce
from rloo_efficient.demo.workload import build_tokenizer, vowel_reward

from .conftest import training_args
from .trees import stock_batch


class EmulatedGraph:
    """A captured forward as a replay sees it: its outputs are buffers that each replay overwrites, computed from the
    captured inputs' tensors as they are then (the test's CPU forward stands in for the kernels)."""

    def __init__(self, step, outputs, wrong: bool):
        self.step, self.outputs, self.wrong = step, outputs, wrong

    def replay(self):
        for buffer, value in zip(self.outputs, self.step(), strict=True):
            if buffer is not None:
                buffer.copy_(value + (1.0 if self.wrong else 0.0))


@pytest.fixture
def emulated_graphs(monkeypatch):
    """The graph path on CPU: the warm-up runs the forward, the capture keeps it to replay; the rest as on CUDA."""
    graphs, faults = [], {}

    def capture(step, device):
        if faults.get("fails"):
            raise RuntimeError("operation not permitted when stream is capturing")
        outputs = tuple(None if value is None else value.clone() for value in step())
        graphs.append(EmulatedGraph(step, outputs, faults.get("wrong", False)))
        return graphs[-1], outputs

    monkeypatch.setattr(graphed, "CAPTURE_DEVICES", ("cpu",))
    monkeypatch.setattr(graphed, "warm_up", lambda step, device, buffers=(): step())
    monkeypatch.setattr(graphed, "capture", capture)
    monkeypatch.setattr(graphed, "_warnings", WarnOnce())  # (the process's: each test warns afresh)
    return graphs, faults


def test_a_row_packed_in_full_scores_its_tokens_as_packed_alone():
    """[`graphed.scored_in_full`]: a row packed with its completion's padding has the same log-probs at its scored
    columns (the padding comes after them), and every row of a prompt packs to the same tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from rloo_efficient.core.layers.install import install

    torch.manual_seed(0)
    # tiny: two layers, float64 so that the two packings compare exactly
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1)).double().eval()  # fmt: skip
    add_fused_lm_head(model)
    install(model)
    prompts = [list(range(3, 14))] * 3
    completions = [[20, 21, 22], [23, 24, 25, 26, 27, 28], [29]]
    input_ids, _, logits_to_keep, rows = stock_batch(prompts, completions)
    sizes = set()
    for row in range(3):
        alone = pack_rows(input_ids[row : row + 1], logits_to_keep, rows[row : row + 1])
        full = pack_rows(input_ids[row : row + 1], logits_to_keep, graphed.scored_in_full(rows[row : row + 1],
                                                                                          logits_to_keep))  # fmt: skip
        sizes.add(full.num_tokens)
        with torch.no_grad():
            a = alone.unpack(model(**alone.model_inputs(), fused_lm_head=True).log_probs)
            b = full.unpack(model(**full.model_inputs(), fused_lm_head=True).log_probs)
        scored = len(completions[row])
        torch.testing.assert_close(b[:, :scored], a[:, :scored], rtol=1e-12, atol=1e-12)
        assert (a[:, scored:] == 0).all() and (b[:, scored:] != 0).all()  # the padding's own log-probs, as stock's
    assert len(sizes) == 1  # every row of the prompt packs alike


# Completions longer than the prompts (40 to 64 tokens), each row's own tokens more than a third of what one of
# stock's forwards holds: no chunks merge. One row per chunk: a group's 4 rows, 4 chunks; two rows: one group of 8 rows
# per generation, 4 chunks (the first eager, the second captured, the others replayed)
SMALL_CHUNKS = {
    1: dict(per_device_train_batch_size=1, gradient_accumulation_steps=8, steps_per_generation=8,
            max_completion_length=80, generation_kwargs={"min_new_tokens": 80}),
    2: dict(per_device_train_batch_size=2, gradient_accumulation_steps=4, steps_per_generation=4, num_generations=8,
            max_completion_length=136, generation_kwargs={"min_new_tokens": 136}),
}  # fmt: skip


def run(trainer_class, path, args, dataset):
    trainer = trainer_class(model=path, reward_funcs=vowel_reward, args=args, train_dataset=dataset,
                            processing_class=build_tokenizer())  # fmt: skip
    trainer.train()
    return trainer


@pytest.mark.parametrize("rows, fault", [(1, None), (2, None), pytest.param(1, "wrong", marks=pytest.mark.slow),
                                         pytest.param(1, "fails", marks=pytest.mark.slow)])  # fmt: skip
def test_small_scoring_chunks_replay_and_match_stock(workload, tmp_path, exact_head, emulated_graphs, monkeypatch, rows,
                                                     fault):  # fmt: skip
    """One or two rows per micro-batch, completions longer than the prompts (so no chunks merge): the reference pass's
    chunks of each held prompt replay one captured forward, and the run is stock's. A replay that differs from the
    eager forward, or a forward that cannot be captured, is caught at first use: eager from there on, one warning.
    The capture pools are let go of once generation and scoring are done, before training (one generation: once)."""
    cfg, path, dataset = workload
    graphs, faults = emulated_graphs
    if fault is not None:
        faults[fault] = True
    settings = {"max_steps": 1, "optim": "sgd", "learning_rate": 1e-1, **SMALL_CHUNKS[rows]}
    stock = run(trl.RLOOTrainer, path, training_args(tmp_path / "s", config_class=trl.RLOOConfig, **settings), dataset)
    released = []  # the graphs captured when the capture pools were let go of
    monkeypatch.setattr(core_graphs, "release_pools", lambda: released.append(len(graphs)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = run(RLOOTrainer, path, training_args(tmp_path / "o", shuffle_groups=False, **settings), dataset)
    messages = [str(w.message) for w in caught if "not from CUDA graphs" in str(w.message)]
    assert list(ours._logs["completion"]) == list(stock._logs["completion"])
    assert ours.held_forward_tokens > 0
    a, b = stock.state.log_history[0], ours.state.log_history[0]
    for key in ("loss", "kl", "grad_norm", "entropy"):
        assert b[key] == pytest.approx(a[key], rel=1e-9, abs=1e-12), (key, a[key], b[key])
    assert released == [len(graphs)]
    if fault is None:
        assert not messages and graphs and ours.graph_replays > 0
    else:
        reason = "differs from the eager forward" if fault == "wrong" else "cannot be captured (RuntimeError"
        assert len(messages) == 1 and reason in messages[0]


def test_no_graphs_where_every_forward_gathers_from_all_processes():
    """Under ZeRO-3 or FSDP each process must run the same forwards: a capture, or a check's extra forward, decided by
    one process's rows alone would leave the others waiting. Graphs only where each process decides alone."""
    from types import SimpleNamespace

    from rloo_efficient.trainers.packed import PackedPasses

    for setting, collective, expected in ((True, False, True), (True, True, False), (False, False, False)):
        ranks = SimpleNamespace(collective=lambda collective=collective: collective)
        passes = PackedPasses(None, None, ranks, None, None, None, prefix=True, graphs=setting, fall_back=print)
        assert passes._graphs is expected


class StubbedCuda:
    """CUDA's stream, graph, pool and device calls stubbed for [`core.graphs`]: what each made and called, in order.
    Devices 0 and 1, 1 current; `captures` lists each capture's (stream, pool id)."""

    def __init__(self, monkeypatch):
        from rloo_efficient.core import graphs

        stubs = self
        self.made, self.calls, self.captures, self.pools = [], [], [], []
        self.streams, self.devices = [None], [1]

        class Stream:
            def __init__(self, device=None):
                self.device = device
                stubs.made.append(self)

            def wait_stream(self, other):
                stubs.calls.append(("wait", self, other))

        class Graph:
            def capture_begin(self, pool=None, capture_error_mode="global"):
                stubs.captures.append((stubs.streams[-1], pool))

            def capture_end(self):
                pass

        class MemPool:
            def __init__(self):
                self.id, self.device = (0, len(stubs.pools) + 1), stubs.devices[-1]
                stubs.pools.append(self)

        self.current = {index: Stream(index) for index in (0, 1)}
        self.made.clear()
        monkeypatch.setattr(core_graphs, "_SIDE_STREAMS", {})
        monkeypatch.setattr(graphs, "_POOLS", {})
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "MemPool", MemPool)
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: self._entered(self.streams, stream))
        monkeypatch.setattr(torch.cuda, "device", lambda index: self._entered(self.devices, index))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.devices[-1])
        monkeypatch.setattr(torch.cuda, "current_stream",
                            lambda device: self.current[1 if device.index is None else device.index])  # fmt: skip

    @staticmethod
    @contextlib.contextmanager
    def _entered(stack: list, value):
        stack.append(value)
        try:
            yield
        finally:
            stack.pop()


def test_every_warm_up_and_capture_on_a_device_runs_on_its_one_side_stream(monkeypatch):
    """[`core.graphs`]: the caching allocator hands a freed block back only to work on the stream that freed it, and
    each new `torch.cuda.Stream` is the next of a pool of 32; so each warm-up and capture on a device runs on one side
    stream made once (CUDA's stream calls stubbed: their order and streams recorded)."""
    from rloo_efficient.core import graphs

    cuda = StubbedCuda(monkeypatch)
    ran = []

    def step():
        ran.append(cuda.streams[-1])
        return torch.zeros(1)

    for device in ("cuda:0", "cuda", "cuda:0", "cuda:1"):
        graphs.warm_up(step, torch.device(device))
        graphs.capture(step, torch.device(device))
    assert [stream.device for stream in cuda.made] == [0, 1]  # one per device, "cuda" is the current one's
    side = {0: cuda.made[0], 1: cuda.made[1]}
    assert ran == [side[0], side[0], side[1], side[1], side[0], side[0], side[1], side[1]]
    assert [stream for stream, _ in cuda.captures] == [side[0], side[1], side[0], side[1]]
    # each side-stream run waits for the current stream's work first, and the current stream for it after
    current = cuda.current
    assert ("wait", side[0], current[0]) in cuda.calls and ("wait", current[0], side[0]) in cuda.calls


def test_every_capture_on_a_device_allocates_from_its_one_pool_until_the_cache_is_released(monkeypatch):
    """[`core.graphs.capture_pool`]: a capture given no pool gets a private one, whose blocks no later capture reuses
    (reserved memory grew with every step's graphs); so every capture on a device shares one pool, made on that device
    and kept between captures, until cached memory is released (`release_cached_memory`, the empty-cache policy's
    boundaries), after which the next capture makes a new one. CUDA's calls stubbed."""
    from rloo_efficient.core import graphs
    from rloo_efficient.profiling import memory

    cuda = StubbedCuda(monkeypatch)

    def step():
        return torch.zeros(1)

    for device in ("cuda:0", "cuda", "cuda:0", "cuda:1"):
        graphs.capture(step, torch.device(device))
    assert [pool.device for pool in cuda.pools] == [0, 1]  # one per device, made there ("cuda": the current one)
    ids = [pool.id for pool in cuda.pools]
    assert [pool for _, pool in cuda.captures] == [ids[0], ids[1], ids[0], ids[1]]
    emptied = []
    monkeypatch.setattr(memory, "_device_memory_api", lambda device: type("Api", (), {
        "empty_cache": staticmethod(lambda: emptied.append(set(graphs._POOLS)))}))  # fmt: skip
    memory.release_cached_memory(torch.device("cuda:0"))
    assert emptied == [set()]  # the pools let go of before the cache is emptied (each then freed with its graphs)
    graphs.capture(step, torch.device("cuda:0"))
    assert len(cuda.pools) == 3 and cuda.captures[-1][1] == cuda.pools[2].id and cuda.pools[2].device == 0


def test_a_failed_capture_leaves_later_captures_a_new_pool(monkeypatch):
    """Where `capture_end` fails, some torch releases leave the pool marked as being captured into, and every later
    capture into it would fail: the next capture on that device gets a new pool (the other device's is kept)."""
    from rloo_efficient.core import graphs

    cuda = StubbedCuda(monkeypatch)
    graphs.capture(lambda: torch.zeros(1), torch.device("cuda:1"))
    graphs.capture(lambda: torch.zeros(1), torch.device("cuda:0"))

    def failing():
        raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError, match="not permitted"):
        graphs.capture(failing, torch.device("cuda:0"))
    graphs.capture(lambda: torch.zeros(1), torch.device("cuda:0"))
    graphs.capture(lambda: torch.zeros(1), torch.device("cuda:1"))
    first, second, failed, new, kept = (pool for _, pool in cuda.captures)
    assert failed == second and new not in (first, second) and kept == first


def test_the_graphs_of_a_pass_are_dropped_together(emulated_graphs, monkeypatch):
    """[`graphed.GraphedForwards.drop`]: a dying graph frees the cuBLAS workspace of the stream it was captured on,
    which every other graph captured on the device's one side stream writes; so no graph is dropped while another
    lives: a released source, or one graph past the live limit, drops them all."""
    from types import SimpleNamespace

    monkeypatch.setattr(graphed, "MAX_LIVE_GRAPHS", 2)

    def call(**inputs):
        return SimpleNamespace(log_probs=torch.zeros(3), entropy=None)

    forwards = graphed.GraphedForwards(torch.nn.Linear(1, 1), torch.device("cpu"), call, entropy=False)
    packed = SimpleNamespace(model_inputs=dict, layout=SimpleNamespace(memo={}))
    forwards._capture(("a", ("p",)), packed)
    forwards._capture(("b", ("q",)), packed)
    forwards.release({"p", "q"})  # every source held: both kept
    assert list(forwards.graphs) == [("a", ("p",)), ("b", ("q",))]
    forwards.release({"q"})  # "p" released: "b" goes with "a"
    assert forwards.graphs == {}
    forwards._capture(("a", ("p",)), packed)
    forwards._capture(("b", ("p",)), packed)
    forwards._capture(("c", ("p",)), packed)  # past the limit: only the new one lives
    assert list(forwards.graphs) == [("c", ("p",))]


def test_a_warm_up_alone_leaves_the_current_stream_waiting_for_the_side_stream(monkeypatch):
    """[`core.graphs.warm_up`]: its output is read next on the current stream, also where the capture after it fails
    (the eager fallback returns the warm-up's logits): the current stream waits for the side stream (CUDA's stream
    calls stood in for). Catches the `current.wait_stream(stream)` dropped from `warm_up` (the suite's other tests
    pass through `capture`, which waits on its own)."""
    calls = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            calls.append((self.name, "waits for", other.name))

    current = Stream("current")
    monkeypatch.setattr(core_graphs, "_SIDE_STREAMS", {})
    monkeypatch.setattr(torch.cuda, "Stream", lambda index: Stream("side"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: current)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    core_graphs.warm_up(lambda: None, torch.device("cuda", 0))
    assert calls == [("side", "waits for", "current"), ("current", "waits for", "side")]
