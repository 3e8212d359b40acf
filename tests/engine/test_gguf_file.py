"""A local .gguf file as the model: LLM("model.gguf") reads the architecture, tokenizer and chat
template from the file and loads its weights natively, giving the registry path's tokens."""
from __future__ import annotations

import pytest

from genpool.engine import LLM, SamplingParams
from genpool.engine.config import EngineConfig

pytestmark = pytest.mark.checkpoint


@pytest.fixture(scope="module")
def gguf_file(smollm2_path):
    from genpool.engine.models.registry import gguf_path
    return gguf_path("smollm2-135m")


def test_a_gguf_file_gives_the_registry_paths_tokens(gguf_file, tmp_path, monkeypatch):
    monkeypatch.setenv("GENPOOL_HOME", str(tmp_path))  # its model directory is written anew
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    chats = [[{"role": "user", "content": q}] for q in ("What is the capital of France?",
                                                      "Name three colours.")]
    with LLM(str(gguf_file), num_kv_blocks=64) as llm:
        assert llm.llm_engine.config.quantization == "gguf"
        assert llm.llm_engine.model_path.is_relative_to(tmp_path)
        layer = llm.llm_engine.runner.model.model.layers[0]
        assert layer.mlp.gate_up.packed.fmt == "Q4_1"  # natively, not unpacked to fp32
        got = [o.outputs[0].token_ids for c in chats for o in llm.chat(c, params)]
        template = llm.llm_engine.apply_chat_template(chats[0])
    with LLM("smollm2-135m", quantization="gguf", num_kv_blocks=64) as ref:
        want = [o.outputs[0].token_ids for c in chats for o in ref.chat(c, params)]
        assert template == ref.llm_engine.apply_chat_template(chats[0])
    assert got == want and all(len(t) == 16 for t in got)


def test_bad_gguf_files_and_options_say_why(tmp_path):
    fake = tmp_path / "notes.gguf"
    fake.write_text("not a model")
    with pytest.raises(ValueError, match="not a GGUF file"):
        LLM(str(fake))
    with pytest.raises(ValueError, match="GGUF file.*int8"):
        EngineConfig(model=str(fake), quantization="int8")
    with pytest.raises(ValueError, match="not a local .gguf file"):
        LLM(str(tmp_path / "missing.gguf"))
