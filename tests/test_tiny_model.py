"""The built-in tiny model: Qwen2's context, and a cached build of another version is rebuilt."""

from __future__ import annotations

import json

from radixserve.testing.tiny_model import BUILD_MARKER, BUILD_VERSION, MAX_POSITIONS, build_version, ensure_tiny_model


def test_tiny_model_has_qwen2_context_and_an_outdated_cache_is_rebuilt(tmp_path):
    path = tmp_path / "tiny-qwen2"
    path.mkdir()
    # A build from before the model was versioned: a 512-position config and no marker.
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    assert build_version(path) == 0
    assert ensure_tiny_model(path) == path
    config = json.loads((path / "config.json").read_text())
    assert config["max_position_embeddings"] == MAX_POSITIONS == 32768
    assert json.loads((path / "tokenizer_config.json").read_text())["model_max_length"] == MAX_POSITIONS
    assert build_version(path) == BUILD_VERSION and (path / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-qwen2"]  # no staging directory left behind
    # A current build is used as it is.
    stamp = (path / BUILD_MARKER).stat().st_mtime_ns, (path / "model.safetensors").stat().st_mtime_ns
    ensure_tiny_model(path)
    assert ((path / BUILD_MARKER).stat().st_mtime_ns, (path / "model.safetensors").stat().st_mtime_ns) == stamp
