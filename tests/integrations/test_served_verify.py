"""ServedModel.verify asks the server (POST /tokenize) whether its prompt ids are the ones
the labels were computed on, and refuses with one line when they are not."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from openai_server import SERVED_NAME, FakeOpenAIServer

from contextkit.pipeline.served.model import LabelRangeError, ServedModel

MESSAGES = [{"role": "system", "content": "[AXIOMS]\nNever invent facts.\n[/AXIOMS]"},
            {"role": "user", "content": "Is checkout slow? ¿Por qué? 🚦"}]


def test_verify_passes_against_the_same_model(openai_server: FakeOpenAIServer,
                                              served_model_dir: Path) -> None:
    served = ServedModel(served_model_dir, name=SERVED_NAME, base_url=openai_server.base_url)
    served.verify(MESSAGES)  # no error: the server's ids are the client's
    assert openai_server.requests[-1]["path"] == "/tokenize"


def test_verify_refuses_a_server_with_another_template(tmp_path: Path,
                                                       served_model_dir: Path) -> None:
    other = tmp_path / "other-template"
    shutil.copytree(served_model_dir, other)
    template = other / "chat_template.jinja"
    # The same model with a template that adds a blank line after each role: other ids.
    text = template.read_text()
    assert "message['role'] + '\n'" in text
    template.write_text(text.replace("message['role'] + '\n'", "message['role'] + '\n\n'"))
    with FakeOpenAIServer(other, model_name=SERVED_NAME) as server:
        assert server.render(MESSAGES)[1] != ServedModel(served_model_dir).render(
            MESSAGES).token_ids
        client = ServedModel(served_model_dir, name=SERVED_NAME, base_url=server.base_url)
        with pytest.raises(LabelRangeError) as refused:
            client.verify(MESSAGES)
    message = str(refused.value)
    assert "\n" not in message and "prompt ids differ" in message
    assert "serve the same model directory" in message


def test_verify_without_a_url_or_server_says_what_to_do(served_model_dir: Path) -> None:
    with pytest.raises(LabelRangeError, match="base_url"):
        ServedModel(served_model_dir).verify(MESSAGES)
    with pytest.raises(LabelRangeError, match="is the server up"):
        ServedModel(served_model_dir, base_url="http://127.0.0.1:9/v1").verify(MESSAGES)
