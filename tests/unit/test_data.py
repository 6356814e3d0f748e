import copy
import json

import datasets
import pytest
import transformers

from helpers import write_jsonl
from relax.rollout.data import LoaderPosition, PromptDataConfig, PromptDataError, PromptLoader, load_prompts
from relax.rollout.partial import GroupSoFar, ResponseSoFar
from relax.rollout.tool_calls import ToolUse
from relax.rollout.tools import Calculator, tool_schema
from relax.tools.tiny_model import CHAT_TEMPLATE, build_tokenizer

ROWS = [{"prompt": "copy 1:", "label": "1"}, {"prompt": "copy 2:", "label": "2"}]
# The tiny tokenizer's template with Qwen3's switch: an empty thought block when thinking is turned off.
THINKING_TEMPLATE = CHAT_TEMPLATE + (
    "{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def thinking_tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("thinking_tokenizer")
    build_tokenizer(directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = THINKING_TEMPLATE
    config_path.write_text(json.dumps(config))
    (directory / "chat_template.jinja").unlink(missing_ok=True)  # where newer transformers keep the template
    return transformers.AutoTokenizer.from_pretrained(directory)


def test_jsonl_chat_template_label_metadata(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"prompt": "copy 7:", "reward_model": {"ground_truth": "7"}, "extra": {"id": 1}},
            {"prompt": [{"role": "user", "content": "add 1+2"}], "reward_model": {"ground_truth": "3"}, "extra": {}},
        ],
    )
    config = PromptDataConfig(str(path), label_key="reward_model.ground_truth", metadata_key="extra")
    prompts, report = load_prompts(config, tokenizer)
    assert [p.label for p in prompts] == ["7", "3"]
    assert prompts[0].metadata == {"id": 1}
    assert prompts[0].text == "<|im_start|>user\ncopy 7:<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(prompts[1].token_ids) == prompts[1].text
    assert (report.rows, report.kept, report.bad_rows) == (2, 2, 0)


def test_parquet_through_datasets(tmp_path, tokenizer):
    path = tmp_path / "d.parquet"
    rows = [{"question": "copy 1:", "answer": "1"}, {"question": "copy 2:", "answer": "2"}]
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    config = PromptDataConfig(str(path), prompt_key="question", label_key="answer", apply_chat_template=False)
    prompts, _ = load_prompts(config, tokenizer)
    assert [(p.row, p.text, p.label) for p in prompts] == [(1, "copy 1:", "1"), (2, "copy 2:", "2")]


@pytest.mark.parametrize(
    "bad_row, message",
    [
        ('{"prompt": "copy 1:"', "row 3: invalid JSON"),
        ({"question": "x", "label": "1"}, "row 3: key 'prompt' missing (row has keys: label, question)"),
        ({"prompt": 5, "label": "1"}, "row 3: 'prompt' must be a string or a list of chat messages, got int"),
        ({"prompt": [{"content": "x"}], "label": "1"}, "row 3: 'prompt' message 0 must be an object"),
        ({"prompt": "copy 1:"}, "row 3: key 'label' missing"),
    ],
)
def test_bad_row_names_file_and_row(tmp_path, tokenizer, bad_row, message):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "label": "1"}, {"prompt": "b", "label": "2"}, bad_row])
    with pytest.raises(PromptDataError) as error:
        load_prompts(PromptDataConfig(str(path)), tokenizer)
    assert f"{path} {message}" in str(error.value)
    assert "--skip-bad-rows" in str(error.value)


def test_skip_bad_rows_counts_and_reports(tmp_path, tokenizer):
    rows = [{"prompt": "a", "label": "1"}, "not json", {"prompt": "b"}, {"prompt": "c", "label": "3"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    prompts, report = load_prompts(PromptDataConfig(str(path), skip_bad_rows=True), tokenizer)
    assert [p.row for p in prompts] == [1, 4]
    assert report.bad_rows == 2
    assert report.bad_row_reasons[0].startswith(f"{path} row 2: invalid JSON")
    assert report.bad_row_reasons[1].startswith(f"{path} row 3: key 'label' missing")
    assert "2 bad rows skipped" in report.summary()


def test_rows_without_metadata_as_the_flags_read_them(tmp_path, tokenizer):
    """--metadata-key defaults to `metadata`: rows of only prompt and label load, with no metadata; a null
    value (a parquet column with gaps) is none too; a value that is not an object is a bad row."""
    rows = [ROWS[0], {**ROWS[1], "metadata": None}, {"prompt": "copy 3:", "label": "3", "metadata": {"id": 3}}]
    config = PromptDataConfig(str(write_jsonl(tmp_path / "d.jsonl", rows)), metadata_key="metadata")
    prompts, report = load_prompts(config, tokenizer)
    assert [p.metadata for p in prompts] == [{}, {}, {"id": 3}]
    assert report.bad_rows == 0

    path = write_jsonl(tmp_path / "bad.jsonl", [*ROWS, {"prompt": "x", "label": "1", "metadata": "id=3"}])
    with pytest.raises(PromptDataError, match=r"bad.jsonl row 3: 'metadata' must be an object, got str"):
        load_prompts(PromptDataConfig(str(path), metadata_key="metadata"), tokenizer)


def test_chat_template_kwargs_reach_the_template(tmp_path, thinking_tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    config = PromptDataConfig(str(path), chat_template_kwargs={"enable_thinking": False})
    off = load_prompts(config, thinking_tokenizer)[0][0]
    assert off.text == "<|im_start|>user\ncopy 1:<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert thinking_tokenizer.decode(off.token_ids) == off.text
    on = load_prompts(PromptDataConfig(str(path), chat_template_kwargs={"enable_thinking": True}), thinking_tokenizer)
    assert on[0][0].text == "<|im_start|>user\ncopy 1:<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_kwargs_the_template_does_not_read_are_refused(tmp_path, tokenizer, thinking_tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(PromptDataError, match="chat template does not read enable_thinking, so it would change"):
        load_prompts(PromptDataConfig(str(path), chat_template_kwargs={"enable_thinking": False}), tokenizer)
    misspelt = PromptDataConfig(str(path), chat_template_kwargs={"enable_thinkin": False})
    with pytest.raises(PromptDataError, match="does not read enable_thinkin, so"):
        load_prompts(misspelt, thinking_tokenizer)


def test_the_prompts_show_the_tools_through_a_chat_template_that_reads_them(tmp_path, tmp_path_factory, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    tools = (tool_schema(Calculator()),)
    tool_chat = build_tokenizer(tmp_path_factory.mktemp("tool_chat"), tool_chat=True)
    prompt = load_prompts(PromptDataConfig(str(path), tools=tools), tool_chat)[0][0]
    assert prompt.text == tool_chat.apply_chat_template([{"role": "user", "content": "copy 1:"}], tools=list(tools),
                                                        tokenize=False, add_generation_prompt=True)
    assert '"name": "calculator"' in prompt.text
    with pytest.raises(PromptDataError, match="--tools, but the tokenizer's chat template does not read `tools`"):
        load_prompts(PromptDataConfig(str(path), tools=tools), tokenizer)


def test_no_chat_template_to_apply_is_refused(tmp_path, tmp_path_factory):
    plain = build_tokenizer(tmp_path_factory.mktemp("plain"))
    plain.chat_template = None
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(PromptDataError, match="the tokenizer has no chat template to apply"):
        load_prompts(PromptDataConfig(str(path)), plain)
    assert len(load_prompts(PromptDataConfig(str(path), apply_chat_template=False), plain)[0]) == 2


def test_system_prompt_goes_first_unless_the_messages_bring_their_own(tmp_path, tokenizer):
    own = [{"role": "system", "content": "be exact."}, {"role": "user", "content": "copy 3:"}]
    rows = [ROWS[0], {"prompt": own, "label": "3"}]
    config = PromptDataConfig(str(write_jsonl(tmp_path / "d.jsonl", rows)), system_prompt="be brief.")
    given, kept = load_prompts(config, tokenizer)[0]
    assert given.text == (
        "<|im_start|>system\nbe brief.<|im_end|>\n<|im_start|>user\ncopy 1:<|im_end|>\n<|im_start|>assistant\n"
    )
    assert kept.text.startswith("<|im_start|>system\nbe exact.<|im_end|>\n<|im_start|>user\ncopy 3:")


def test_empty_message_list_is_a_bad_row(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [ROWS[0], {"prompt": [], "label": "1"}])
    with pytest.raises(PromptDataError, match="row 2: 'prompt' is an empty list of chat messages"):
        load_prompts(PromptDataConfig(str(path)), tokenizer)


def test_messages_without_chat_template_is_an_error(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": [{"role": "user", "content": "x"}], "label": 1}])
    with pytest.raises(PromptDataError, match="row 1: .*chat template is off"):
        load_prompts(PromptDataConfig(str(path), apply_chat_template=False), tokenizer)


def test_length_filter_is_counted(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ab", "label": 1}, {"prompt": "abcdefgh", "label": 2}])
    config = PromptDataConfig(str(path), apply_chat_template=False, max_prompt_tokens=4)
    prompts, report = load_prompts(config, tokenizer)
    assert [p.text for p in prompts] == ["ab"]
    assert (report.filtered_too_long, report.kept) == (1, 1)


def test_missing_file_and_unknown_type(tmp_path, tokenizer):
    with pytest.raises(PromptDataError, match="does not exist"):
        load_prompts(PromptDataConfig(str(tmp_path / "nope.jsonl")), tokenizer)
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(PromptDataError, match="unsupported data file type '.csv'"):
        load_prompts(PromptDataConfig(str(tmp_path / "d.csv")), tokenizer)


def test_unreadable_files_name_the_file(tmp_path, tokenizer):
    (tmp_path / "d.parquet").write_text("not parquet")
    with pytest.raises(PromptDataError, match=r"d.parquet: cannot be read as a parquet file \(ArrowInvalid"):
        load_prompts(PromptDataConfig(str(tmp_path / "d.parquet")), tokenizer)
    (tmp_path / "d.jsonl").write_bytes(b'{"prompt": "\xff"}\n')
    with pytest.raises(PromptDataError, match="d.jsonl: not UTF-8 text"):
        load_prompts(PromptDataConfig(str(tmp_path / "d.jsonl")), tokenizer)


def _texts_and_labels(directory, tokenizer):
    prompts, _ = load_prompts(PromptDataConfig(str(directory), apply_chat_template=False), tokenizer)
    return [(p.row, p.text, p.label) for p in prompts]


def test_save_to_disk_directories(tmp_path, tokenizer):
    train, test = datasets.Dataset.from_list(ROWS), datasets.Dataset.from_list([{"prompt": "copy 9:", "label": "9"}])
    train.save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict(test=test, train=train).save_to_disk(str(tmp_path / "splits"))
    expected = [(1, "copy 1:", "1"), (2, "copy 2:", "2")]
    assert _texts_and_labels(tmp_path / "one", tokenizer) == expected
    assert _texts_and_labels(tmp_path / "splits", tokenizer) == expected  # the train split
    assert _texts_and_labels(tmp_path / "splits" / "test", tokenizer) == [(1, "copy 9:", "9")]


def test_hub_style_directories(tmp_path, tokenizer):
    """Data files under a folder, as a dataset downloaded from the Hub lies on disk: the train split, or the
    only one; chat messages stored in parquet read as lists of dicts."""
    hub = tmp_path / "hub"
    (hub / "data").mkdir(parents=True)
    datasets.Dataset.from_list(ROWS).to_parquet(str(hub / "data" / "train-00000-of-00001.parquet"))
    datasets.Dataset.from_list([{"prompt": "copy 9:", "label": "9"}]).to_parquet(
        str(hub / "data" / "test-00000-of-00001.parquet")
    )
    assert _texts_and_labels(hub, tokenizer) == [(1, "copy 1:", "1"), (2, "copy 2:", "2")]

    chat = tmp_path / "chat"
    chat.mkdir()
    messages = [{"prompt": [{"role": "user", "content": f"copy {i}:"}], "label": str(i)} for i in (4, 5)]
    write_jsonl(chat / "math.jsonl", messages)
    prompts, _ = load_prompts(PromptDataConfig(str(chat)), tokenizer)
    assert [p.text for p in prompts][1] == "<|im_start|>user\ncopy 5:<|im_end|>\n<|im_start|>assistant\n"


def test_directory_problems_name_the_directory_and_row(tmp_path, tokenizer):
    no_train = tmp_path / "no_train"
    datasets.DatasetDict(
        validation=datasets.Dataset.from_list(ROWS), test=datasets.Dataset.from_list(ROWS)
    ).save_to_disk(str(no_train))
    with pytest.raises(PromptDataError, match="splits validation, test and none named 'train'; point --prompt-data"):
        load_prompts(PromptDataConfig(str(no_train)), tokenizer)
    (tmp_path / "empty").mkdir()
    with pytest.raises(PromptDataError, match=r"empty: cannot be read as a dataset directory \(EmptyDatasetError"):
        load_prompts(PromptDataConfig(str(tmp_path / "empty")), tokenizer)
    bad = tmp_path / "bad"
    datasets.Dataset.from_list([*ROWS, {"prompt": None, "label": "3"}]).save_to_disk(str(bad))
    with pytest.raises(PromptDataError, match=f"{bad} row 3: 'prompt' must be a string or a list of chat messages"):
        load_prompts(PromptDataConfig(str(bad)), tokenizer)


def _prompts(tmp_path, tokenizer, count):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}", "label": i} for i in range(count)])
    return load_prompts(PromptDataConfig(str(path), apply_chat_template=False), tokenizer)[0]


def test_loader_epochs_are_seeded_permutations(tmp_path, tokenizer):
    prompts = _prompts(tmp_path, tokenizer, 10)
    loader = PromptLoader(prompts, seed=3, num_epochs=2)
    first, second = loader.take(10), loader.take(10)
    assert sorted(p.label for p in first) == list(range(10)) == sorted(p.label for p in second)
    assert [p.label for p in first] != [p.label for p in second]
    assert loader.exhausted and loader.take(4) == []
    assert [p.label for p in PromptLoader(prompts, seed=3).take(10)] == [p.label for p in first]
    assert [p.label for p in PromptLoader(prompts, seed=4).take(10)] != [p.label for p in first]
    assert [p.label for p in PromptLoader(prompts, shuffle=False).take(3)] == [0, 1, 2]


def test_loader_resumes_at_its_position(tmp_path, tokenizer):
    prompts = _prompts(tmp_path, tokenizer, 7)
    reference = PromptLoader(prompts, seed=1)
    expected = [p.label for p in reference.take(20)]  # crosses two epoch boundaries

    loader = PromptLoader(prompts, seed=1)
    served = [p.label for p in loader.take(9)]
    assert loader.position == LoaderPosition(epoch=1, index=2)
    resumed = PromptLoader.from_state_dict(prompts, loader.state_dict())
    served += [p.label for p in resumed.take(11)]
    assert served == expected

    with pytest.raises(PromptDataError, match="resume position index 9 is outside the 7 prompts"):
        PromptLoader(prompts, position=LoaderPosition(0, 9))
    with pytest.raises(PromptDataError, match="saved loader served 7 prompts, this run has 6; resume with the same"):
        PromptLoader.from_state_dict(prompts[:6], loader.state_dict())


def test_loader_state_keeps_the_order_it_was_saved_with(tmp_path, tokenizer):
    prompts = _prompts(tmp_path, tokenizer, 7)
    loader = PromptLoader(prompts, seed=1, shuffle=False)
    loader.take(3)
    state = json.loads(json.dumps(loader.state_dict()))  # a checkpoint stores it as JSON
    assert [p.label for p in PromptLoader.from_state_dict(prompts, state).take(4)] == [3, 4, 5, 6]


def test_prompts_put_back_come_first_and_are_saved_with_the_loader(tmp_path, tokenizer):
    prompts = _prompts(tmp_path, tokenizer, 7)
    loader = PromptLoader(prompts, seed=1, shuffle=False, num_epochs=1)
    taken = loader.take(4)
    loader.put_back([taken[3], taken[1]])  # a step's aborted groups, in submission order
    state = json.loads(json.dumps(loader.state_dict()))
    assert [p.label for p in loader.take(3)] == [3, 1, 4]
    resumed = PromptLoader.from_state_dict(prompts, state, num_epochs=1)
    assert [p.label for p in resumed.take(5)] == [3, 1, 4, 5, 6]  # a resumed run serves them too, nothing lost
    assert resumed.exhausted
    resumed.put_back([prompts[0]])
    assert not resumed.exhausted and [p.label for p in resumed.take(2)] == [0]
    with pytest.raises(PromptDataError, match=r"the prompts put back \[9\] are not all among the 7 prompts"):
        PromptLoader.from_state_dict(prompts, {**state, "put_back": [9]})


def test_a_multi_turn_response_put_back_is_saved_with_its_loss_mask_and_turns(tmp_path, tokenizer):
    prompts = _prompts(tmp_path, tokenizer, 2)
    loader = PromptLoader(prompts, shuffle=False)
    multi_turn = ResponseSoFar([5, 6, 7], [-0.5, 0.0, -0.7], [0, 0, 1], text="x", loss_mask=[1, 0, 1],
                               tool_use=ToolUse(turns=2, tool_calls=1, tool_failures=1))
    so_far = GroupSoFar([multi_turn, ResponseSoFar([8], [-0.8], [1])])
    loader.put_back(loader.take(1), [so_far])
    state = json.loads(json.dumps(loader.state_dict()))  # a checkpoint stores it as JSON
    ((prompt, resumed),) = PromptLoader.from_state_dict(prompts, state).take_with_progress(1)
    assert prompt.label == 0 and resumed == so_far
    assert (resumed.responses[0].loss_mask, resumed.responses[0].tool_use) == ([1, 0, 1], ToolUse(2, 1, 1))
    # a saved response without the multi-turn fields (as earlier checkpoints hold) is a single-turn one
    single = {"token_ids": [8], "logprobs": [-0.8], "steps": [1], "finish_reason": "abort", "text": ""}
    assert GroupSoFar.from_state_dict({"responses": [single]}) == GroupSoFar([ResponseSoFar([8], [-0.8], [1])])


def test_a_custom_generate_functions_responses_put_back_are_saved_with_their_prompt_metadata_and_reward(
        tmp_path, tokenizer):
    prompts = _prompts(tmp_path, tokenizer, 2)
    loader = PromptLoader(prompts, shuffle=False)
    aborted = ResponseSoFar([5, 6], [-0.5, 0.0], [0, 0], text="x", loss_mask=[1, 0], prompt_ids=[4, 4, 4],
                            metadata={"turn": 1, "notes": ["a"]})
    finished = ResponseSoFar([8], [-0.8], [0], "stop", "y", reward=0.5, prompt_ids=[4, 4, 4])
    so_far = GroupSoFar([aborted, finished, ResponseSoFar([9], [-0.9], [0], "length")])  # a fan-out's third
    loader.put_back(loader.take(1), [so_far])
    state = json.loads(json.dumps(loader.state_dict()))  # a checkpoint stores it as JSON
    ((prompt, resumed),) = PromptLoader.from_state_dict(prompts, state).take_with_progress(1)
    assert prompt.label == 0 and resumed == so_far


def test_a_copy_of_the_loader_keeps_what_was_put_back_and_the_partial_responses_as_they_were(tmp_path, tokenizer):
    prompts = _prompts(tmp_path, tokenizer, 4)
    loader = PromptLoader(prompts, shuffle=False)
    so_far = GroupSoFar([ResponseSoFar([5], [-0.5], [0]), ResponseSoFar()])
    loader.put_back(loader.take(2), [so_far, None])
    saved = copy.copy(loader)  # the state the async loop saves while the next rollout takes prompts
    (first, taken), (second, nothing) = loader.take_with_progress(2)
    taken.responses[0] = ResponseSoFar()  # what a rollout does with the group it took
    assert (first.label, second.label, nothing) == (0, 1, None) and taken == GroupSoFar([ResponseSoFar()] * 2)
    assert saved.state_dict()["put_back"] == [0, 1] and saved.take_with_progress(1)[0][1] == so_far
    loader.put_back([prompts[2]], [so_far])
    with pytest.raises(RuntimeError, match="must be taken with take_with_progress"):  # never drops the tokens
        loader.take(1)
