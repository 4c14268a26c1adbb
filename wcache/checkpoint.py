"""Checks of a checkpoint directory before the daemon hands it to vLLM: a
truncated or damaged file is named in one line (:class:`CheckpointCorrupt`,
:class:`ConfigInvalid`) instead of a traceback from deep inside the load.

Reads only ``config.json`` and each safetensors header (8 bytes of length, then
that many bytes of JSON); never tensor data.

Source: the safetensors format (https://github.com/huggingface/safetensors,
"Format": u64 little-endian header size N, N bytes of JSON header with
``dtype``/``shape``/``data_offsets`` per tensor relative to the end of the header).
"""

from __future__ import annotations

import json
import os

from wcache.errors import CheckpointCorrupt, ConfigInvalid

__all__ = ["check_checkpoint_dir", "check_config", "check_safetensors"]

#: Bytes of the header-size field at the start of a safetensors file (a u64).
SAFETENSORS_LENGTH_BYTES = 8
#: Largest header the safetensors library accepts (100 MB, its MAX_HEADER_SIZE);
#: a larger length is damage, and is refused before reading it.
SAFETENSORS_MAX_HEADER_BYTES = 100_000_000
CONFIG_FILE = "config.json"
#: What to do about a damaged file.
REFETCH_FIX = (
    "download or copy the checkpoint again (e.g. `huggingface-cli download REPO "
    "--local-dir DIR`), then run the command again"
)


def check_config(model_dir: str) -> None:
    """``config.json`` exists and is a JSON object.

    Raises:
        ConfigInvalid: ``<file>: <what>``, with the fix.
    """
    path = os.path.join(model_dir, CONFIG_FILE)
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise ConfigInvalid(
            f"{path}: missing; a checkpoint directory holds its model's "
            f"config.json next to the weights"
        ) from None
    except UnicodeDecodeError as e:
        raise ConfigInvalid(
            f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); {REFETCH_FIX}"
        ) from None
    except json.JSONDecodeError as e:
        raise ConfigInvalid(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno} column "
            f"{e.colno}); fix the file or {REFETCH_FIX}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigInvalid(f"{path}: a JSON {type(data).__name__}, not an object; {REFETCH_FIX}")


def check_safetensors(path: str) -> None:
    """One safetensors file is complete: its header parses and every tensor's
    data lies inside the file.

    Raises:
        CheckpointCorrupt: ``<file>: <what>``, with the fix.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(SAFETENSORS_LENGTH_BYTES)
        if len(head) < SAFETENSORS_LENGTH_BYTES:
            raise CheckpointCorrupt(
                f"{path}: {size} bytes, shorter than the "
                f"{SAFETENSORS_LENGTH_BYTES}-byte header length: truncated; "
                f"{REFETCH_FIX}"
            )
        n = int.from_bytes(head, "little")
        if n > SAFETENSORS_MAX_HEADER_BYTES or SAFETENSORS_LENGTH_BYTES + n > size:
            raise CheckpointCorrupt(
                f"{path}: header of {n} bytes does not fit in the file's "
                f"{size} bytes: truncated or not a safetensors file; "
                f"{REFETCH_FIX}"
            )
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointCorrupt(
                f"{path}: header is not valid JSON ({e}); {REFETCH_FIX}"
            ) from None
    if not isinstance(header, dict):
        raise CheckpointCorrupt(f"{path}: header is not a JSON object; {REFETCH_FIX}")
    data_bytes = size - SAFETENSORS_LENGTH_BYTES - n
    end, last = 0, None
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and o >= 0 for o in offsets)
            and offsets[0] <= offsets[1]
        ):
            raise CheckpointCorrupt(
                f"{path}: tensor {name!r} has no valid data_offsets; {REFETCH_FIX}"
            )
        if offsets[1] > end:
            end, last = offsets[1], name
    if end > data_bytes:
        raise CheckpointCorrupt(
            f"{path}: tensor {last!r} ends at data byte {end}, but the file "
            f"holds {data_bytes} data bytes: truncated (an interrupted "
            f"download or copy); {REFETCH_FIX}"
        )


def check_checkpoint_dir(model_dir: str) -> None:
    """``config.json`` and every ``*.safetensors`` file of ``model_dir`` (see
    :func:`check_config`, :func:`check_safetensors`), in that order.

    Raises:
        ConfigInvalid, CheckpointCorrupt: the first problem found.
    """
    check_config(model_dir)
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            check_safetensors(os.path.join(model_dir, name))
