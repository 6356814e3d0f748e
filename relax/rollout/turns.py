"""The ids a multi-turn rollout appends after an assistant turn, from the tokenizer's chat template.

The trained sequence of a multi-turn sample is the prompt, then for each turn the ids the engine sampled followed by
the ids relax appended (the end of the assistant turn, the tool turn, the next assistant header); nothing is ever
re-tokenized. Rendering the whole conversation again and tokenizing it would not give the same ids: the template
rewrites what the model wrote (Qwen3's normalises a thinking block and writes tool calls with its own JSON spacing),
and a model may sample a tokenization of its text that the tokenizer would not produce ("\\n" "\\n" for "\\n\\n").

So only the text that follows an assistant turn is taken from the template: the conversation is rendered with a
marker as the assistant's content, the text after the marker is what the template writes between that turn's
content and the next turn's, and its tokens are appended. In ChatML templates (Qwen's) that text starts with
<|im_end|>, a special token, so tokenizing it alone gives the ids it has inside the whole conversation; in any
template, the ids appended are the ones trained and the ones the engine is sent next, so the sequence stays exact.
A model that stopped on the end-of-turn token (its EOS) sampled it already: it is not appended twice.

    turns = ChatTurns(tokenizer, {"enable_thinking": False})
    ids = turns.after_assistant(sampled_ids, ["3", "7"])  # two tool results: one user turn, two <tool_response>
"""

MARKER = "RELAX_ASSISTANT_CONTENT_MARKER"  # the assistant content the template renders; found again by its text
ANY_USER_TURN = {"role": "user", "content": "question"}  # the conversation's start: only what follows it is kept


class ChatTurns:
    def __init__(self, tokenizer, chat_template_kwargs: dict | None = None):
        """`tokenizer`: a HF tokenizer with a chat template; `chat_template_kwargs`: the template's own options, as
        the prompts were rendered with (Qwen3's enable_thinking changes the next assistant header)."""
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        # What the template writes after an assistant's content when the conversation ends there: its end of turn.
        self.end_of_turn_ids = self._ids_after_assistant([], add_generation_prompt=False)
        if not self.end_of_turn_ids:
            raise ValueError("the chat template writes nothing after an assistant turn; a multi-turn rollout needs "
                             "a template that ends each turn (ChatML's <|im_end|>)")

    def after_assistant(self, sampled_ids: list[int], tool_outputs: list[str]) -> list[int]:
        """The ids to append after an assistant turn the engine sampled (`sampled_ids`) whose tool calls returned
        `tool_outputs` (one text per call, in call order): the rest of the end of turn, the tool turn(s) as the
        template writes them (consecutive tool messages as it merges them), and the next assistant header."""
        return self.after_assistant_messages(sampled_ids, [{"role": "tool", "content": text} for text in tool_outputs])

    def after_assistant_messages(self, sampled_ids: list[int], messages: list[dict]) -> list[int]:
        """after_assistant for any chat messages that follow the sampled turn (tool results, a user's next message,
        as an agent sends them: relax.rollout.agent_session)."""
        ids = self._ids_after_assistant(messages)
        if ids[: len(self.end_of_turn_ids)] != self.end_of_turn_ids:
            raise ValueError(
                "the chat template ends an assistant turn differently when these messages follow it "
                f"({self._decode(ids[:len(self.end_of_turn_ids)])!r} instead of "
                f"{self._decode(self.end_of_turn_ids)!r}); relax cannot tell which ids end a turn"
            )
        return ids[self.sampled_end_of_turn(sampled_ids):]

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The ids of a conversation's prompt as relax.rollout.data renders a row of chat messages: the template with
        its generation prompt, tokenized without special tokens added."""
        text = self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=True, **self.chat_template_kwargs)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def sampled_end_of_turn(self, sampled_ids: list[int]) -> int:
        """How many of the end-of-turn ids the sampled turn ends with (the EOS it stopped on), longest first."""
        for count in range(len(self.end_of_turn_ids), 0, -1):
            if sampled_ids[-count:] == self.end_of_turn_ids[:count]:
                return count
        return 0

    def _ids_after_assistant(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        conversation = [ANY_USER_TURN, {"role": "assistant", "content": MARKER}, *messages]
        text = self.tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **self.chat_template_kwargs
        )
        if text.count(MARKER) != 1:
            raise ValueError(f"the chat template does not write an assistant's content as given: {text!r:.300}")
        return self.tokenizer.encode(text[text.index(MARKER) + len(MARKER):], add_special_tokens=False)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)
