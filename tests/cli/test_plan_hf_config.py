"""`plan --hf-config CONFIG.json`: a Hugging Face model's config.json planned as `plan` plans a model of a size, and
the messages for a file that is not one."""

import json

import pytest

from minioffload.cli.main import main
from minioffload.planner.plan import Plan
from minioffload.predict.shapes import ModelSpec

# a Llama-3.2-1B-like config: 16 blocks of 2048, 32 heads / 8 kv, SwiGLU 8192, a tied head
LLAMA_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
            "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 8192,
            "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": True,
            "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 500000.0}


def _exit_code(argv) -> int | None:
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def test_plan_takes_a_hugging_face_config(tmp_path, capsys):
    config, out = tmp_path / "config.json", tmp_path / "plan.json"
    config.write_text(json.dumps(LLAMA_1B))
    assert main(["plan", "--hf-config", str(config), "--seq-len", "2048", "--hardware", "rtx4090", "--batch", "4",
                 "--nvme-gb", "0", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("Llama of 1.24B (16 x 2048, 32 heads / 8 kv, SwiGLU 8192, context 2048) on rtx4090")
    assert "chosen:" in text
    plan = Plan.load(out)
    assert plan.model == ModelSpec.from_config(LLAMA_1B, seq_len=2048) and plan.step_s > 0


@pytest.mark.parametrize("content,match", [
    (None, "there is no file"),
    ("{not json", "is not JSON"),
    ("[1, 2]", "holds a JSON list"),
    (json.dumps({**LLAMA_1B, "model_type": "t5"}), "got model_type 't5'. Describe the model by hand"),
])
def test_plan_names_a_config_it_cannot_read(tmp_path, capsys, content, match):
    config = tmp_path / "config.json"
    if content is not None:
        config.write_text(content)
    assert _exit_code(["plan", "--hf-config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "--hf-config" in err and match in err


def test_hf_config_excludes_the_other_model_arguments(tmp_path, capsys):
    assert _exit_code(["plan", "--hf-config", str(tmp_path / "config.json"), "--params", "7B"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err
