"""Native checkpoints: copies of device directories (states file + manifest, and the
small tensors' directory in one).

A device directory is consistent when its manifest describes its states file, so every
copy writes the states first and the manifest last, through a temporary name and an
atomic rename: an interrupted copy leaves states without a manifest (refused as a
checkpoint and by a Pipeline, until the copy is redone) instead of a manifest over
foreign states.
``shutil.copyfile`` uses ``copy_file_range``/``sendfile`` (a reflink where the file system
has them), so no copy passes through Python buffers.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from typing import Optional, Sequence

from smartinf.pipeline.devices import SMALL_DIRECTORY

STATES = "states.bin"
MANIFEST = "manifest"

logger = logging.getLogger("smartinf")


def manifest_fields(directory: str) -> Optional[dict]:
    """The ``key value`` lines of the manifest a directory holds, as strings (the format
    the native store writes, read without opening the run); None where it holds none."""
    try:
        with open(os.path.join(directory, MANIFEST), errors="replace") as f:
            return dict(line.strip().partition(" ")[::2] for line in f if line.strip())
    except OSError:
        return None


def never_committed(directory: str) -> bool:
    """Whether ``directory`` holds a run killed before its first durable commit: a manifest
    (written when a pipeline claims the directory) of no step and no sub-group (the first
    durable commit, or a close, records them) over states laid out (a pipeline closed or
    failed before any sub-group was added leaves an empty states file: nothing happened)."""
    fields = manifest_fields(directory)
    try:
        laid_out = os.path.getsize(os.path.join(directory, STATES)) > 0
    except OSError:
        laid_out = False
    return fields is not None and laid_out and fields.get("step", "0") == "0" \
        and fields.get("subgroups", "0") == "0"


def stored_subgroups(directory: str) -> list[int]:
    """The sizes (params) of the sub-groups a directory's manifest holds (``sg`` lines:
    id, numel, ...); none where it holds no manifest."""
    try:
        with open(os.path.join(directory, MANIFEST), errors="replace") as f:
            return [int(line.split()[2]) for line in f if line.startswith("sg ")]
    except OSError:
        return []


#: A directory with a log's step files (copies="log", store/step_log.h): never copied.
LOG_FILES = ("grads.bin", "journal")


def manifest_copies(fields: dict) -> "int | str":
    """The ``copies`` setting of the run whose manifest ``fields`` are: 1 or 2 extents per
    chunk (2 before version 9, which did not say), or ``"log"`` (version 10: one extent
    each, spares and a gradient log)."""
    if "log" in fields:
        return "log"
    return int(fields["copies"]) if fields.get("copies") in ("1", "2") else 2


def copy_device_dir(source: str, target: str) -> None:
    """Makes ``target`` hold the committed states of device directory ``source`` (and of
    the small tensors' directory in it, ``devices.small_directory``, where it has one)."""
    small = os.path.join(source, SMALL_DIRECTORY)
    if os.path.isfile(os.path.join(small, MANIFEST)):
        copy_device_dir(small, os.path.join(target, SMALL_DIRECTORY))
    elif os.path.isdir(os.path.join(target, SMALL_DIRECTORY)):
        shutil.rmtree(os.path.join(target, SMALL_DIRECTORY))  # of another run
    for name in (STATES, MANIFEST):
        if not os.path.isfile(os.path.join(source, name)):
            raise FileNotFoundError(f"{source} is not a smartinf device directory: no {name}")
    os.makedirs(target, exist_ok=True)
    manifest = os.path.join(target, MANIFEST)
    if os.path.exists(manifest):
        os.remove(manifest)  # from here on the target is not taken for a committed directory
    for name in LOG_FILES:  # a log of the target's own run would finish a step of another
        if os.path.exists(os.path.join(target, name)):
            os.remove(os.path.join(target, name))
    shutil.copyfile(os.path.join(source, STATES), os.path.join(target, STATES))
    staged = manifest + ".copy"
    shutil.copyfile(os.path.join(source, MANIFEST), staged)
    _fsync(os.path.join(target, STATES))
    _fsync(staged)
    os.replace(staged, manifest)
    _fsync(target)


def save_devices(paths: Sequence[str], directory: str) -> list[str]:
    """Copies device directories ``paths`` to ``directory/device-<i>``; returns those."""
    if os.path.exists(directory) and os.listdir(directory):
        raise FileExistsError(f"{directory} is not empty; save into a new directory")
    targets = [os.path.join(directory, f"device-{i}") for i in range(len(paths))]
    for path, target in zip(paths, targets):
        copy_device_dir(path, target)
    return targets


def save_param_groups(param_groups: Sequence[dict], directory: str) -> None:
    """The param groups' hyper-parameters (``param_groups.json``, written whole or not at
    all) beside the device directories ``save_devices`` copied."""
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in param_groups]
    with tempfile.NamedTemporaryFile("w", dir=directory, delete=False) as f:
        json.dump(hyper, f, default=str)
    os.replace(f.name, os.path.join(directory, "param_groups.json"))


def restore_devices(directory: str, paths: Sequence[str]) -> None:
    """Copies a checkpoint made by :func:`save_devices` back into device directories
    ``paths`` (whose Pipeline must be closed); the device count must match."""
    saved = sorted(d for d in os.listdir(directory) if d.startswith("device-")) \
        if os.path.isdir(directory) else []
    if len(saved) != len(paths):
        raise ValueError(f"{directory} holds {len(saved)} device directories, this run has "
                         f"{len(paths)} devices; restore with the device count it was saved with")
    for i, path in enumerate(paths):
        copy_device_dir(os.path.join(directory, f"device-{i}"), path)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def refuse_never_committed(devices: list, if_exists: str) -> None:
    """A run killed before its first durable commit (``never_committed``) holds
    nothing to resume: with ``if_exists="error"`` refused, as any run a directory holds (a
    framework that restored its model's weights of a later step would otherwise get fresh
    states beside them); with ``"resume"`` it starts at step 0 from the model's weights,
    said at warning level."""
    paths = [str(getattr(d, "path", d)) for d in devices]
    found = [p for p in paths if never_committed(p)]
    if not found or if_exists == "overwrite":
        return
    if if_exists == "resume":
        logger.warning("%s holds a run that never committed a step (stopped before its first "
                       "durable commit): nothing to resume; it starts at step 0 from the "
                       "model's weights, in the run's format", ", ".join(found))
        return
    raise ValueError(f"{', '.join(found)} holds a run that never committed a step: it was "
                     f"stopped before its first durable commit (every commit_every steps), so "
                     f"nothing there can be resumed, and the model's weights may be those of a "
                     f"later step than fresh states. Pass if_exists='overwrite' to start afresh "
                     f"from the model's weights, or if_exists='resume' to take it at step 0 "
                     f"(the same fresh states, its format kept)")
