"""The OpenAI API's default model name: readable for the embedded model (whose cache
directory's name is hashed), the directory's name otherwise."""

from __future__ import annotations

from disagg.model import default
from disagg.model.default import DEFAULT_SERVED_NAME, served_model_name


def test_the_embedded_models_cache_directory_is_served_by_its_readable_name(tmp_path,
                                                                             monkeypatch):
    monkeypatch.setenv(default.ENV_CACHE_DIR, str(tmp_path))
    converted = tmp_path / "SmolLM2-135M-Instruct-Q4_1-0123456789ab-c3"
    converted.mkdir()
    assert served_model_name(converted) == DEFAULT_SERVED_NAME == "SmolLM2-135M-Instruct"
    assert served_model_name(str(converted)) == DEFAULT_SERVED_NAME


def test_other_directories_are_served_by_their_name(tmp_path, monkeypatch):
    monkeypatch.setenv(default.ENV_CACHE_DIR, str(tmp_path / "cache"))
    hashed_elsewhere = tmp_path / "model-0123456789ab-c3"  # the pattern, not in the cache
    assert served_model_name(hashed_elsewhere) == "model-0123456789ab-c3"
    assert served_model_name(tmp_path / "Llama-3.2-1B") == "Llama-3.2-1B"
    monkeypatch.setenv(default.ENV_CACHE_DIR, str(tmp_path))
    assert served_model_name(tmp_path / "my-model") == "my-model"  # in the cache, not converted
