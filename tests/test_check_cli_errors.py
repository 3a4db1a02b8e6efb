"""``python -m fastlayers check`` on broken model folders and bad ``--json`` paths: one line
naming the file and the problem, exit code 2 (1 means "the check failed"), and ``--traceback``
for the loader's own trace."""

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers as tf
from fastlayers.patching.checking import models as hf_models
from tiny_models import TINY

from fastlayers.__main__ import main

TINY_BERT = {"num_hidden_layers": 2, **TINY}
QUICK = ("--device", "cpu", "--batch", "2", "--seq", "8", "--runs", "1")
ERROR = "python -m fastlayers check: error: "


@pytest.fixture(autouse=True)
def _no_progress_bars():
    # transformers' "Loading weights" bar goes to stderr too; it is not an error line, and
    # without it stderr holds the CLI's own lines only.
    was_enabled = tf.utils.logging.is_progress_bar_enabled()
    tf.utils.logging.disable_progress_bar()
    yield
    if was_enabled:
        tf.utils.logging.enable_progress_bar()


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["check", *args])
    out, err = capsys.readouterr()
    return code, out, err


def error_line(err: str) -> str:
    """The one error line of stderr; fails unless every other line is a progress line."""
    lines = [line for line in err.splitlines() if not line.startswith("[fastlayers] ")]
    assert len(lines) == 1 and lines[0].startswith(ERROR), err
    return lines[0]


def bert_folder(path: Path) -> Path:
    tf.BertModel(tf.BertConfig(**TINY_BERT)).save_pretrained(path)
    return path


def bin_folder(path: Path) -> Path:
    """A folder with its weights in pytorch_model.bin only (transformers 5 saves safetensors)."""
    model = tf.BertModel(tf.BertConfig(**TINY_BERT))
    model.save_pretrained(path)
    (path / "model.safetensors").unlink()
    torch.save(model.state_dict(), path / "pytorch_model.bin")
    return path


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 1234\n"


@pytest.mark.parametrize(
    "corrupt, reason",
    [
        (lambda p: p.write_bytes(b"garbage " * 16), "Error while deserializing header"),
        (truncate, "incomplete metadata, file not fully covered"),
        (lambda p: p.write_text(LFS_POINTER), "is a Git LFS pointer"),
        (lambda p: p.write_bytes(b""), "is empty"),
    ],
    ids=["garbage", "truncated", "lfs-pointer", "empty"],
)
def test_corrupt_safetensors_is_one_line_and_exit_2(capsys, tmp_path, corrupt, reason):
    folder = bert_folder(tmp_path / "model")
    corrupt(folder / "model.safetensors")
    report = tmp_path / "report.json"
    code, out, err = cli(capsys, str(folder), *QUICK, "--json", str(report))
    line = error_line(err)
    assert code == 2 and "model.safetensors" in line and reason in line, err
    assert out == "" and not report.exists()  # nothing ran; the --json probe left no file


@pytest.mark.parametrize(
    "corrupt, reason",
    [
        (
            lambda p: p.write_bytes(b"garbage " * 16),
            "is not a PyTorch checkpoint (neither a zip archive nor a pickle)",
        ),
        (truncate, "is corrupt: PytorchStreamReader failed reading zip archive"),
    ],
    ids=["garbage", "truncated"],
)
def test_corrupt_pytorch_model_bin_is_one_line_and_exit_2(capsys, tmp_path, corrupt, reason):
    folder = bin_folder(tmp_path)
    corrupt(folder / "pytorch_model.bin")
    code, _, err = cli(capsys, str(folder), *QUICK)
    line = error_line(err)
    assert code == 2 and f"pytorch_model.bin {reason}" in line, err


def test_sound_pytorch_model_bin_still_loads(capsys, tmp_path):
    code, out, err = cli(capsys, str(bin_folder(tmp_path)), *QUICK)
    assert code == 0 and out.strip().splitlines()[-1].startswith("PASS"), out + err


def test_traceback_shows_the_loaders_own_trace(capsys, tmp_path):
    folder = bert_folder(tmp_path)
    (folder / "model.safetensors").write_bytes(b"garbage " * 16)
    with pytest.raises(hf_models.ModelFolderError, match=r"model\.safetensors is corrupt") as info:
        main(["check", str(folder), *QUICK, "--traceback"])
    # The safetensors error, with its frames, is chained as the cause.
    assert "SafetensorError" in type(info.value.__cause__).__name__
    assert info.value.__cause__.__traceback__ is not None


@contextlib.contextmanager
def transformers_logs() -> Iterator[list[logging.LogRecord]]:
    """The records transformers' logger passes on to its handlers while the block runs."""
    logged: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = logged.append
    logging.getLogger("transformers").addHandler(handler)
    try:
        yield logged
    finally:
        logging.getLogger("transformers").removeHandler(handler)


def test_weights_of_the_wrong_shape_for_the_config(capsys, tmp_path):
    folder = bert_folder(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128)
    (folder / "config.json").write_text(json.dumps(config))
    # transformers logs a table of every mismatched weight before it raises: held back.
    with transformers_logs() as logged:
        code, _, err = cli(capsys, str(folder), *QUICK)
    line = error_line(err)
    assert code == 2 and "the weights do not match config.json" in line, err
    assert "embeddings.LayerNorm.bias is [32] in the weights file, [64] by config.json" in line
    assert not [r for r in logged if "LOAD REPORT" in r.getMessage()]


def test_load_report_of_a_model_that_loads_is_still_logged(capsys, tmp_path):
    """Holding transformers' logs back during the load must not lose them when it succeeds:
    a head missing from the weights is reported (and the check runs)."""
    folder = bert_folder(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["BertForSequenceClassification"]
    (folder / "config.json").write_text(json.dumps(config))
    with transformers_logs() as logged:
        code, out, err = cli(capsys, str(folder), *QUICK)
    assert code == 0, out + err
    assert [r for r in logged if "classifier.weight" in r.getMessage()]


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "config.json is not valid JSON: Expecting property name"),
        ("[1, 2]", "config.json is not a JSON object"),
    ],
    ids=["not-json", "not-an-object"],
)
def test_broken_config_json_before_loading(capsys, tmp_path, content, message):
    folder = bert_folder(tmp_path)
    (folder / "config.json").write_text(content)
    code, _, err = cli(capsys, str(folder), *QUICK)
    assert code == 2 and message in error_line(err), err
    assert "loading the model" not in err  # found before the slow load


def test_broken_modules_json_names_the_file(capsys, tmp_path):
    folder = bert_folder(tmp_path)
    (folder / "modules.json").write_text('[{"type": ')
    code, _, err = cli(capsys, str(folder), *QUICK)
    assert code == 2 and "modules.json is not valid JSON: Expecting value" in error_line(err)


def tokenizer_folder(path: Path) -> Path:
    """A tiny BERT with a WordPiece tokenizer of a few words (tokenizer.json and
    tokenizer_config.json)."""
    bert_folder(path)
    words = "[PAD] [UNK] [CLS] [SEP] [MASK] a man is playing the guitar".split()
    tokenizer = tf.BertTokenizer(vocab={word: i for i, word in enumerate(words)})
    tokenizer.save_pretrained(path)
    return path


def test_sound_tokenizer_is_used(capsys, tmp_path):
    code, out, err = cli(capsys, str(tokenizer_folder(tmp_path)), *QUICK)
    assert code == 0 and "sentences through its tokenizer" in err, out + err


@pytest.mark.parametrize(
    "name, content, message",
    [
        (
            "tokenizer.json",
            "{not json",
            "tokenizer.json is broken (not valid JSON: Expecting property name",
        ),
        (
            "tokenizer.json",
            '{"version": "1.0", "model": 5}',
            "tokenizer.json is broken (data did not match any variant",
        ),
        (
            "tokenizer_config.json",
            '{"model_max_length": ',
            "tokenizer_config.json is broken (not valid JSON: Expecting value",
        ),
    ],
    ids=["not-json", "not-a-tokenizer", "config-not-json"],
)
def test_broken_tokenizer_is_named_not_called_missing(capsys, tmp_path, name, content, message):
    folder = tokenizer_folder(tmp_path)
    (folder / name).write_text(content)
    code, _, err = cli(capsys, str(folder), *QUICK)
    assert code == 2 and message in error_line(err), err
    assert "has no tokenizer" not in err


def read_only_report_path(tmp_path: Path) -> Path:
    """A path no report can be written to: a read-only folder, or for root (who writes
    there anyway) a file under /sys."""
    if os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir()
        folder.chmod(0o555)
        return folder / "report.json"
    path = Path("/sys/fastlayers-report.json")
    try:
        path.open("a").close()
    except OSError:
        return path
    path.unlink()
    pytest.skip("no location on this machine refuses root's writes")


@pytest.mark.parametrize("where", ["a folder", "read-only"])
def test_json_path_that_cannot_be_written_fails_before_loading(capsys, tmp_path, where):
    folder = bert_folder(tmp_path / "model")
    path = tmp_path if where == "a folder" else read_only_report_path(tmp_path)
    code, out, err = cli(capsys, str(folder), *QUICK, "--json", str(path))
    line = error_line(err)
    expected = "is a folder" if where == "a folder" else "cannot write there"
    assert code == 2 and f"--json {path}: {expected}" in line, err
    assert out == "" and "loading the model" not in err  # before the model loads


def test_json_to_an_existing_file_keeps_it_until_the_report_replaces_it(capsys, tmp_path):
    """The --json probe opens the file without truncating it, and the report then replaces
    it (a broken model stops before: the old content stays)."""
    folder = bert_folder(tmp_path / "model")
    report = tmp_path / "report.json"
    report.write_text("old")
    (folder / "model.safetensors").write_bytes(b"")
    assert cli(capsys, str(folder), *QUICK, "--json", str(report))[0] == 2
    assert report.read_text() == "old"
    bert_folder(folder)
    code, out, err = cli(capsys, str(folder), *QUICK, "--json", str(report))
    assert code == 0 and json.loads(report.read_text())["passed"], out + err


@pytest.mark.parametrize("seq", ["1", "2"])
def test_sequence_shorter_than_the_special_tokens_is_bad_usage(capsys, tmp_path, seq):
    folder = tokenizer_folder(tmp_path)
    args = ("--device", "cpu", "--batch", "2", "--seq", seq, "--runs", "1")
    code, out, err = cli(capsys, str(folder), *args)
    assert code == 2 and out == "", out + err
    assert f"--seq {seq} leaves no room for text" in error_line(err)


def audio_folder(path: Path, model_cls=tf.Wav2Vec2Model, config_cls=tf.Wav2Vec2Config, **extra):
    """A tiny audio model with a feature extractor's preprocessor_config.json and a CTC vocab
    (a tokenizer that loads: the check must feed audio anyway)."""
    config = config_cls(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, **extra)
    model_cls(config).save_pretrained(path)
    tf.Wav2Vec2FeatureExtractor().save_pretrained(path)
    (path / "vocab.json").write_text(json.dumps({"<pad>": 0, "<unk>": 1, "a": 2, "|": 3}))
    return path


def test_audio_model_folder_is_fed_random_audio(capsys, tmp_path):
    folder = audio_folder(
        tmp_path,
        intermediate_size=37,
        conv_dim=(8, 8),
        conv_stride=(5, 4),
        conv_kernel=(10, 4),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
    )
    code, out, err = cli(capsys, str(folder), *QUICK)
    assert code == 0 and "random audio [2, 160 samples]" in err, out + err
    assert out.strip().splitlines()[-1].startswith("PASS"), out


def test_model_taking_features_it_cannot_make_is_bad_usage(capsys, tmp_path):
    config = tf.WhisperConfig(
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=8,
    )
    tf.WhisperModel(config).save_pretrained(tmp_path)
    code, out, err = cli(capsys, str(tmp_path), *QUICK)
    assert code == 2 and "takes input_features" in error_line(err), out + err
