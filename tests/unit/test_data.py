import json

import pytest

from relax.rollout.data import LoaderPosition, PromptDataConfig, PromptDataError, PromptLoader, load_prompts
from relax.tiny_model import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


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
    import datasets

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
