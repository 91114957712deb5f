"""Generation backends ([`rloo_efficient.core.generation.backends`]): chosen once per trainer from its facts, each
saying what it shares, and a new backend is one class and one registration."""

import warnings

import pytest
import torch

from rloo_efficient import RLOOTrainer
from rloo_efficient.core.generation import backends, static_decode
from rloo_efficient.core.generation.backends import (
    VLLM,
    BackendFacts,
    ContinuousBatching,
    GenerateLoop,
    GenerationBackend,
    StaticDecoding,
    choose,
)
from rloo_efficient.demo.workload import build_tokenizer, vowel_reward

from .conftest import training_args
from .helpers import build


def facts(policy, use_vllm=False, continuous_batching=False, static_decoding=None, device="cpu") -> BackendFacts:
    return BackendFacts(use_vllm, continuous_batching, static_decoding, torch.device(device), policy)


@pytest.fixture(scope="module")
def policy():
    return build("llama")


@pytest.mark.parametrize("flags, captured, chosen", [
    ({"use_vllm": True, "static_decoding": True}, True, VLLM),  # TRL's own backends first
    ({"continuous_batching": True}, True, ContinuousBatching),
    ({"static_decoding": True}, False, StaticDecoding),  # asked for: on any device
    ({"static_decoding": None}, True, StaticDecoding),  # the default: where steps are captured as graphs
    ({"static_decoding": None}, False, GenerateLoop),
    ({"static_decoding": False}, True, GenerateLoop),
])  # fmt: skip
def test_the_backend_is_the_first_registered_that_runs(policy, monkeypatch, flags, captured, chosen):
    monkeypatch.setattr(static_decode, "CAPTURE_DEVICES", ("cpu",) if captured else ("cuda",))
    backend = choose(facts(policy, **flags))
    assert type(backend) is chosen and backend == chosen() and (backend == GenerateLoop()) == (chosen is GenerateLoop)
    assert backend.prefills == (chosen not in (VLLM, ContinuousBatching))  # TRL's share prompts in their own caches
    assert backend.static == (chosen is StaticDecoding)


def test_a_model_split_across_devices_decodes_in_generates_loop_by_default(policy, monkeypatch):
    """A capture runs on one stream: a model on several devices is not captured, so the default decodes in `generate`'s
    loop there (as `generate_with_shared_prefill(static=None)` decides per call)."""
    monkeypatch.setattr(static_decode, "CAPTURE_DEVICES", ("cpu",))
    monkeypatch.setattr(policy, "hf_device_map", {"model.layers.0": 0, "model.layers.1": 1}, raising=False)
    assert type(choose(facts(policy))) is GenerateLoop


class OwnCache(GenerationBackend):
    """A backend that shares prompts by itself (say, a server with a prefix cache), where the config asks for it (here:
    `static_decoding=True`, a flag a test can set)."""

    name, own_sharing = "own-cache server", "prompts in the server's cache"

    @classmethod
    def runs(cls, facts: BackendFacts) -> bool:
        return facts.static_decoding is True


def test_a_new_backend_is_one_class_and_one_registration(workload, tmp_path, monkeypatch):
    """Registered, a backend is asked after those before it and before our own two: the trainer that it runs for
    takes it (before static decoding, which would run there too), its prefill off with one warning naming the backend
    and what it shares; the others keep theirs."""
    cfg, path, dataset = workload
    monkeypatch.setattr(backends, "_REGISTERED", list(backends.registered()))
    assert backends.register(OwnCache) is OwnCache and backends.registered()[-1] is OwnCache

    def trainer(**settings):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            built = RLOOTrainer(model=path, reward_funcs=vowel_reward, train_dataset=dataset,
                                args=training_args(tmp_path, **settings), processing_class=build_tokenizer())  # fmt: skip
        said = [w for w in caught if "generation runs stock TRL's" in str(w.message)]
        assert all(w.filename == __file__ for w in said)  # pointing at the user's line that built the trainer
        return built, [str(w.message) for w in said]

    ours, said = trainer(static_decoding=True)
    assert type(ours._switches.backend) is OwnCache and not ours._switches.prefill
    assert said == ["rloo_efficient: generation runs stock TRL's own-cache server backend (it shares prompts in the "
                    "server's cache), so our shared prefill is off; the log-prob, training and reward passes are "
                    "still ours."]  # fmt: skip
    ours, said = trainer(static_decoding=False)
    assert said == [] and type(ours._switches.backend) is GenerateLoop and ours._switches.prefill
    assert ours._generation.backend is ours._switches.backend  # the generation part decodes with the chosen one
