"""A crafted checkpoint reads nothing outside its directory and changes nothing when it fails
(lomo_kernels.load_checkpoint in one process).

Each file here is crafted as someone sharing a checkpoint could craft it, with the manifest
re-recorded so that its CRC-32s vouch for the files: metadata that places tensors in files
outside the directory or beyond their ends, links, a manifest naming paths or leaving files
out, and bytes that do not hold what the metadata says. Each is refused with a
`CheckpointError` naming the problem, with the model and optimizer unchanged bit for bit and,
where a file outside the directory is named, that file never opened.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import re
import sys
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.checkpointed import trained_with_moments as trained
from support.crafted import (
    RunsCode,
    rerecord_manifest,
    rewrite_metadata,
    storage_of,
)
from support.models import batch, tiny_llama
from support.state import assert_refused, assert_same_state
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from lomo_kernels import CheckpointError, load_checkpoint, save_checkpoint
from lomo_kernels.checkpoint import safe_loading
from lomo_kernels.checkpoint.state import model_state, optimizer_state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

# The model entry read last (its bytes are the last the load writes into the model).
LAST = "model.model.norm.weight"


@pytest.fixture
def opened():
    """The paths the process opens while the test runs (an audit hook cannot be removed: it
    records only while the list is live)."""
    seen: list[str] = []
    live = [True]

    def hook(event: str, args: tuple) -> None:
        if live[0] and event == "open" and isinstance(args[0], str | bytes):
            seen.append(str(args[0]))

    sys.addaudithook(hook)
    yield seen
    live[0] = False


def assert_refused_whole(load, match: str) -> None:
    """`load(model, opt)` on a differently trained model and AdaLomo is refused, changing
    neither (the optimizer's whole state_dict included)."""
    model, opt = trained(seed=1, steps=2)
    before = opt.state_dict()
    assert_refused(model, opt, lambda: load(model, opt), CheckpointError, match)
    assert_same_state(opt.state_dict(), before)


@pytest.mark.parametrize("trust", [False, True], ids=["untrusted", "trusted"])
@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_metadata_placing_tensors_outside_the_directory_refused(checkpoint, opened, where, trust):
    """A storage entry names a file beside the checkpoint (a real one, of another model:
    read, it would load that model's weights unchecked); refused trusted too (trust lets a
    load unpickle, never read files its manifest does not list)."""
    outside = checkpoint.parent / "outside.distcp"
    outside.write_bytes((checkpoint / "__0_0.distcp").read_bytes())
    name = "../outside.distcp" if where == "relative" else str(outside)

    def redirect(metadata):
        for index, info in list(metadata.storage_data.items()):
            if index.fqn.startswith("model."):
                metadata.storage_data[index] = dataclasses.replace(info, relative_path=name)

    file = rewrite_metadata(checkpoint, redirect)
    opened.clear()
    match = rf"{file} places 'model\..*' in '{name}', which is not a file its manifest lists"
    load = lambda m, o: load_checkpoint(checkpoint, m, o, trust_checkpoint=trust)  # noqa: E731
    assert_refused_whole(load, match)
    assert not [p for p in opened if "outside" in p]


def test_metadata_placing_a_tensor_in_a_file_the_manifest_leaves_out_refused(checkpoint):
    (checkpoint / "extra.distcp").write_bytes((checkpoint / "__0_0.distcp").read_bytes())

    def redirect(metadata):
        index, info = storage_of(metadata, LAST)
        metadata.storage_data[index] = dataclasses.replace(info, relative_path="extra.distcp")

    file = rewrite_metadata(checkpoint, redirect)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    del manifest["files"]["extra.distcp"]  # re-recorded with it: left out again
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    match = rf"{file} places '{LAST}' in 'extra.distcp', which is not a file its manifest"
    assert_refused_whole(lambda m, o: load_checkpoint(checkpoint, m, o), match)


@pytest.mark.parametrize("trust", [False, True], ids=["untrusted", "trusted"])
def test_metadata_placing_a_tensor_past_its_files_end_refused(checkpoint, trust):
    """A length past the file's end (a load would read a short slice, or a huge one), trusted
    or not."""

    def stretch(metadata):
        index, info = storage_of(metadata, LAST)
        metadata.storage_data[index] = dataclasses.replace(info, length=1 << 40)

    file = rewrite_metadata(checkpoint, stretch)
    match = rf"{file} places '{LAST}' at bytes \d+\+{1 << 40} of __0_0.distcp, which holds"
    load = lambda m, o: load_checkpoint(checkpoint, m, o, trust_checkpoint=trust)  # noqa: E731
    assert_refused_whole(load, match)


@pytest.mark.parametrize("trust", [False, True], ids=["untrusted", "trusted"])
def test_metadata_placing_a_tensor_behind_a_stream_transform_refused(checkpoint, trust):
    """A storage entry read through a stream transform (zstd decompression, torch's one
    registered extension): a save writes none, and a transform turns a few bytes of the file
    into any number (a decompression bomb), so it is refused before any file is read."""

    def compress(metadata):
        index, info = storage_of(metadata, LAST)
        metadata.storage_data[index] = dataclasses.replace(
            info, transform_descriptors=["stream.zstd/1"]
        )

    file = rewrite_metadata(checkpoint, compress)
    match = rf"{file} places '{LAST}' behind the transforms \['stream.zstd/1'\]"
    load = lambda m, o: load_checkpoint(checkpoint, m, o, trust_checkpoint=trust)  # noqa: E731
    assert_refused_whole(load, match)


def test_metadata_giving_a_tensor_entry_as_bytes_refused(checkpoint):
    """A model entry recorded as pickled bytes instead of a tensor would be loaded in place
    of the parameter, not into it."""

    def as_bytes(metadata):
        metadata.state_dict_metadata[LAST] = BytesStorageMetadata()

    rewrite_metadata(checkpoint, as_bytes)
    match = rf"the checkpoint's '{LAST}' is not a tensor: it was written for another model"
    assert_refused_whole(lambda m, o: load_checkpoint(checkpoint, m, o), match)


@pytest.mark.parametrize("bytes_of", ["another tensor's", "no tensor's"])
def test_tensor_bytes_unlike_the_metadata_refused_before_any_change(checkpoint, bytes_of):
    """Consistent metadata and manifest, every shape right, but the model entry read last
    points at bytes that do not hold it: another tensor of another shape, or bytes that are
    no torch.save at all. Read into the model as they come, the model's other entries and the
    optimizer's state would already be loaded when it fails."""

    def misplace(metadata):
        index, info = storage_of(metadata, LAST)
        if bytes_of == "another tensor's":
            _, other = storage_of(metadata, "model.model.embed_tokens.weight")
            metadata.storage_data[index] = dataclasses.replace(other)
        else:
            metadata.storage_data[index] = dataclasses.replace(info, offset=info.offset + 7)

    rewrite_metadata(checkpoint, misplace)
    match = rf"reading {checkpoint} failed \(.*\): its files do not hold what its metadata says"
    assert_refused_whole(lambda m, o: load_checkpoint(checkpoint, m, o), match)


def test_a_linked_file_refused_unless_trusted(checkpoint, tmp_path):
    """A file of the checkpoint that is a symbolic link (here to the same file of another
    checkpoint, whose bytes match the manifest's record): not followed, unless the caller
    trusts the checkpoint (a hub cache's snapshot links its files into a blob store)."""
    model, opt = trained()
    other = save_checkpoint(tmp_path / "other", model, opt, client_state={"step": 1})
    shard = checkpoint / "__0_0.distcp"
    shard.unlink()
    shard.symlink_to(other / "__0_0.distcp")
    match = rf"{shard} is a symbolic link, which a load does not follow .*\(cp -rL\)"
    assert_refused_whole(lambda m, o: load_checkpoint(checkpoint, m, o), match)
    fresh, fresh_opt = trained(seed=1, steps=2)
    assert load_checkpoint(checkpoint, fresh, fresh_opt, trust_checkpoint=True) == {"step": 1}
    assert_same_state(fresh.state_dict(), model.state_dict())
    assert_same_state(fresh_opt.state_dict(), opt.state_dict())


def test_a_directory_in_place_of_a_file_refused(checkpoint):
    """A directory where the manifest lists a file, its record matching the directory's size:
    refused as not a regular file (read, it would fail with an OSError outside the ranks'
    agreement; a FIFO there would block the load)."""
    file = checkpoint / "client_state_0.pt"
    file.unlink()
    file.mkdir()
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][file.name]["bytes"] = file.stat().st_size
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    match = rf"{file} is not a regular file \(a directory or a device\)"
    assert_refused_whole(lambda m, o: load_checkpoint(checkpoint, m, o), match)


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04truncated"], ids=["empty", "truncated"])
def test_a_client_state_that_is_no_torch_file_refused(checkpoint, content):
    """A client state that torch.load fails on (not for a class it refuses): a CheckpointError
    like every other refusal, so that under several ranks every rank agrees on it."""
    file = checkpoint / "client_state_0.pt"
    file.write_bytes(content)
    rerecord_manifest(checkpoint)
    match = rf"{file} is not a torch.save file \(.*\): the checkpoint is corrupt or crafted"
    assert_refused_whole(lambda m, o: load_checkpoint(checkpoint, m, o), match)


@pytest.mark.parametrize(
    "error",
    [KeyboardInterrupt(), MemoryError(), OSError(errno.EIO, "Input/output error")],
    ids=["interrupt", "memory", "disk"],
)
def test_an_interrupted_read_is_not_called_a_corrupt_checkpoint(checkpoint, monkeypatch, error):
    """An interrupt, a memory or a disk error while the entries are read says nothing of
    the checkpoint: it is raised as it is, not as a CheckpointError a caller may catch to
    fall back to an older checkpoint."""

    def interrupted(self, read_item):
        raise error

    monkeypatch.setattr(safe_loading.SafePlanner, "resolve_tensor", interrupted)
    model, opt = trained(seed=1, steps=2)
    before = opt.state_dict()
    with pytest.raises(BaseException) as raised:
        load_checkpoint(checkpoint, model, opt)
    assert not isinstance(raised.value, CheckpointError)
    assert type(error).__name__ in str(raised.value) or isinstance(raised.value, type(error))
    assert_same_state(opt.state_dict(), before)


# A backslash is a separator on Windows: refused everywhere, as the same manifest could be
# read there.
@pytest.mark.parametrize(
    "name", ["../secret.txt", "/etc/hostname", "sub/file", "..", "..\\secret.txt"]
)
def test_a_manifest_naming_paths_refused_opening_nothing_outside(checkpoint, opened, name):
    secret = checkpoint.parent / "secret.txt"
    secret.write_text("not part of the checkpoint")
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": 26, "crc32": 0}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    opened.clear()
    match = rf"lists {re.escape(repr(name))}, which is not a file of {checkpoint} itself"
    assert_refused_whole(lambda m, o: load_checkpoint(checkpoint, m, o), match)
    assert not [p for p in opened if "secret" in p or "hostname" in p]


@pytest.mark.parametrize("left_out", [".metadata", "client_state_0.pt"])
def test_a_manifest_leaving_out_a_file_every_save_writes_refused(checkpoint, left_out):
    """A manifest that does not list a file the load reads would vouch for nothing of it
    (with `.metadata` left out, a flipped byte in it would load unnoticed)."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    del manifest["files"][left_out]
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    match = rf"does not list {left_out}, which every save writes"
    assert_refused_whole(lambda m, o: load_checkpoint(checkpoint, m, o), match)


UNREADABLE = r"manifest.json is unreadable \({}\): the checkpoint is corrupt"


def _malformed_record(manifest: dict) -> str:
    manifest["files"][".metadata"] = {"bytes": "12", "crc32": None}
    return UNREADABLE.format(r"the record of '.metadata' is .*")


def _another_format(manifest: dict) -> str:
    manifest["format"] = 2  # a later layout, which this reader cannot vouch for
    return UNREADABLE.format("format 2")


def _no_world_size(manifest: dict) -> str:
    # No rank's client_state file would then be required to be listed.
    manifest["world_size"] = 0
    return "manifest.json gives no world size: the checkpoint is corrupt"


@pytest.mark.parametrize(
    "malform",
    [_malformed_record, _another_format, _no_world_size],
    ids=["malformed record", "another format", "no world size"],
)
def test_a_malformed_manifest_refused(checkpoint, malform):
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    match = malform(manifest)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    assert_refused_whole(lambda m, o: load_checkpoint(checkpoint, m, o), match)


def test_each_files_crc_covers_all_its_bytes_and_a_flip_in_its_first_chunk_is_refused(
    tmp_path, monkeypatch
):
    """Files are checksummed in chunks; with chunks of 64 bytes every file here takes several,
    and each record must still be the file's size and the CRC-32 of all its bytes (zlib's,
    over the whole file): a byte flipped in a shard's first chunk is refused."""
    monkeypatch.setattr("lomo_kernels.checkpoint.manifest._CHUNK", 64)
    path = save_checkpoint(tmp_path / "ckpt", *trained(), client_state={"step": 1})
    records = json.loads((path / "manifest.json").read_text())["files"]
    for name, record in records.items():
        data = (path / name).read_bytes()
        assert len(data) > 64, name  # more than one chunk
        assert record == {"bytes": len(data), "crc32": zlib.crc32(data)}, name
    shard = next(name for name in records if name.endswith(".distcp"))
    data = bytearray((path / shard).read_bytes())
    data[10] ^= 0x10
    (path / shard).write_bytes(bytes(data))
    match = rf"{shard} does not match its manifest's CRC-32"
    assert_refused_whole(lambda m, o: load_checkpoint(path, m, o), match)


def test_a_torch_optimizers_state_is_unchanged_by_a_refused_load(tmp_path):
    """A torch optimizer's state is loaded in place (its own tensors, not copies): a load
    refused for an entry that would run code leaves every moment as it was."""
    marker = tmp_path / "code-ran"

    def adam(seed: int, steps: int):
        model = tiny_llama(seed=seed)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for index in range(steps):
            model(**batch(index)).loss.backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    model, opt = adam(0, 1)
    state = {"model": model_state(model), "optimizer": optimizer_state(model, opt)}
    state["optimizer"]["param_groups"][0]["lr"] = RunsCode(marker)
    path = tmp_path / "ckpt"
    save_checkpoint(path, model, opt)
    (path / ".metadata").unlink()  # written anew (torch warns over an existing one)
    dcp.save(state, checkpoint_id=path, no_dist=True)
    rerecord_manifest(path)
    model, opt = adam(1, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]
    with pytest.raises(CheckpointError, match=r"'optimizer.param_groups.0.lr' holds a Python"):
        load_checkpoint(path, model, opt)
    assert not marker.exists()
    assert_same_state(model.state_dict(), before)
    assert_same_state([dict(s) for s in opt.state.values()], moments)
