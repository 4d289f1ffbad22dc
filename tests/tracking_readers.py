"""Read back what megarl's W&B and MLflow sinks wrote, for tests (unit and end to end).

W&B: an offline run is one `run-<id>.wandb` file, the records the W&B service would have sent,
each a `wandb_internal_pb2.Record` protobuf, framed as W&B's datastore frames them (a LevelDB
log: a 7-byte file header, then 32 KiB blocks of chunks, each with a CRC-32 of its type and
data, a length and a type: full, or first/middle/last of a record split over blocks). W&B
ships no reader for it in Python (its service is Go), so this is one; every CRC is checked.
MLflow: its own client over the store.
"""
from __future__ import annotations

import json
import struct
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)  # ident, magic, version 0
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: str | Path):
    """Every Record of a `.wandb` file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:len(HEADER)] == HEADER, f"{path}: not a W&B datastore ({data[:7]!r})"
    pos, parts = len(HEADER), []
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a chunk header is zero padding
            pos += left
            continue
        crc, n, kind = struct.unpack_from("<IHB", data, pos)
        if kind == 0 and n == 0 and crc == 0:  # zeros: padding to the block's end
            pos += left
            continue
        if pos + 7 + n > len(data):  # a chunk still being written: the records so far
            return
        chunk = data[pos + 7:pos + 7 + n]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad CRC at {pos}"
        pos += 7 + n
        parts = [chunk] if kind in (FULL, FIRST) else parts + [chunk]
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            yield record


def _items(items) -> dict:
    return {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in items}


@dataclass
class WandbRun:
    """An offline W&B run as read back: its run record, config and history rows."""
    dir: Path
    project: str
    name: str
    config: dict
    history: list[dict] = field(default_factory=list)

    def metric(self, name: str, step_key: str = "training/global_step") -> dict:
        """step -> value of `name`, over the rows that have it."""
        return {row[step_key]: row[name] for row in self.history if name in row}


def wandb_offline_runs(root: str | Path) -> list[WandbRun]:
    """The offline runs under `root` (a WANDB_DIR or a run directory), oldest first."""
    runs = []
    for f in sorted(Path(root).glob("wandb/offline-run-*/run-*.wandb")):
        # W&B's service writes the file on its own; `finish()` returning does not promise the
        # last records are on disk yet (a loaded CI run read one without its run record), so
        # wait for the run's exit record, which is written last
        deadline = time.monotonic() + 60
        while not any(r.WhichOneof("record_type") == "exit" for r in wandb_records(f)) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        run = None
        for r in wandb_records(f):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                cfg = {k: v for k, v in _items(r.run.config.update).items() if k != "_wandb"}
                run = WandbRun(f.parent, r.run.project, r.run.display_name, cfg)
            elif kind == "history" and run is not None:
                run.history.append(_items(r.history.item))
        assert run is not None, f"{f}: no run record"
        runs.append(run)
    return runs


def mlflow_run(tracking_uri: str, experiment: str, run_name: str):
    """(client, run) of the one run named `run_name` in `experiment`."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"{tracking_uri}: no experiment {experiment!r}"
    runs = client.search_runs([exp.experiment_id],
                              filter_string=f"attributes.run_name = '{run_name}'")
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return client, runs[0]


def mlflow_json_artifact(client, run_id: str, path: str):
    local = client.download_artifacts(run_id, path)
    return json.loads(Path(local).read_text())
