"""Chat prompts with generated turns spliced in (http/chat_prompt.py, issue 30.4): the
prompt of turn k+1 is turn k's prompt, then the tokens generated for turn k exactly (even
where the text would tokenize otherwise, and without writing its end of turn twice), then
the template's rendering of what follows; with nothing kept, the template renders all."""

from __future__ import annotations

from pathlib import Path

from kvstrata.http.chat_prompt import chat_prompt_ids
from kvstrata.http.protocol import ChatMessage
from kvstrata.model.tokenizer import Tokenizer
from kvstrata.server.generated_turns import (
    GeneratedTurns,
    conversation_key,
    message_key,
    turn_key,
)


def user(text: str) -> ChatMessage:
    return ChatMessage(role="user", content=text)


def test_the_next_prompt_extends_the_last_prompt_and_its_output(tiny_llama: Path) -> None:
    tok = Tokenizer(tiny_llama)
    first = [user("What is two and two?")]
    prompt = chat_prompt_ids(tok, first)
    answer = "It is four."
    # Token by token: not how the tokenizer would cut the text, as a sampled output may be.
    generated = [tok.encode(ch, add_special_tokens=False)[0] for ch in answer]
    end = tok.token_to_id("<|im_end|>")
    assert end is not None and generated != tok.encode(answer, add_special_tokens=False)
    generated.append(end)
    history = [*first, ChatMessage(role="assistant", content=answer), user("And three?")]
    spliced = chat_prompt_ids(tok, history, generated={1: generated})
    assert spliced[: len(prompt) + len(generated)] == prompt + generated
    rendered = chat_prompt_ids(tok, history)  # the template's own rendering of that turn
    assert rendered[: len(prompt)] == prompt and rendered != spliced
    tail = tok.decode(spliced[len(prompt) + len(generated) :], skip_special_tokens=False)
    assert not tail.startswith("<|im_end|>")  # the turn's end is not written twice
    assert tail.endswith("And three?<|im_end|>\n<|im_start|>assistant\n")


def test_answers_are_found_by_what_the_client_holds() -> None:
    turns = GeneratedTurns(max_turns=2)
    before_call = conversation_key([user("x")])
    turns.remember(turn_key(before_call, None, [("f", '{"a":1}')]), [1, 2, 3])
    called = ChatMessage.model_validate(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_x",
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"a": 1}'},
                }
            ],
        }
    )
    hello = ChatMessage(role="assistant", content="hello")
    turns.remember(turn_key(conversation_key([user("x"), called]), "hello", []), [4, 5])
    history = [user("x"), called, hello, user("y")]
    assert turns.generated_in(history) == {1: [1, 2, 3], 2: [4, 5]}
    assert message_key(before_call, called) == turn_key(before_call, None, [("f", '{"a": 1}')])
    turns.remember(turn_key(before_call, "third", []), [6])  # the least recently used goes
    assert len(turns) == 2 and turns.generated_in(history) == {2: [4, 5]}
    off = GeneratedTurns(max_turns=0)
    off.remember(turn_key(conversation_key([user("x"), called]), "hello", []), [4, 5])
    assert off.generated_in(history) == {}


def test_an_answer_is_spliced_only_into_its_own_conversation() -> None:
    """Generated tokens may hold what the client never saw (a think block the template
    drops): another conversation sending the same answer text gets the template's
    rendering, not them."""
    turns = GeneratedTurns(max_turns=8)
    turns.remember(turn_key(conversation_key([user("secret question")]), "42", []), [7, 8])
    mine = [user("secret question"), ChatMessage(role="assistant", content="42"), user("?")]
    theirs = [user("another question"), ChatMessage(role="assistant", content="42"), user("?")]
    assert turns.generated_in(mine) == {1: [7, 8]}
    assert turns.generated_in(theirs) == {}
