"""How cogni-tool serve's chat endpoint turns a conversation into an app's prompt."""

from __future__ import annotations

from cogni_tool.serve import app_prompt


def test_one_user_message_is_the_prompt_as_written() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "Remember: buy milk"},
    ]
    assert app_prompt(messages) == "Remember: buy milk"


def test_a_conversation_is_given_whole_as_a_transcript() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "Remember: buy milk"},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "What did I say?"},
    ]
    assert app_prompt(messages) == (
        "system: be brief\n\nuser: Remember: buy milk\n\nassistant: Noted.\n\nuser: What did I say?"
    )


def test_an_assistant_message_alone_is_a_transcript_too() -> None:
    assert app_prompt([{"role": "assistant", "content": "hi"}]) == "assistant: hi"
