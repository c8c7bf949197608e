"""trackers=tensorboard: event files, by default under <run dir>/trackers/tensorboard.

The config goes in as hyperparameters (TensorBoard's HPARAMS tab) and as one text summary,
`config`; each batch's figures as scalars at a step counted in tokens; at the end the
totals as scalars under `final/` and the status as a text summary, `final/status`. A resumed
run writes a new event file into the same folder, which TensorBoard reads as one run.

The events are written with the `tensorboard` package's own event-file writer and protocol
buffers (what torch's `SummaryWriter` and tensorboardX write through too), not through
`torch.utils.tensorboard`: importing torch cost the trackers' process about 2 CPU seconds a run,
the tensorboard modules a tenth of that. One event per batch holds all its scalars.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from forge.config.trackers import TensorBoardSettings
from forge.tracker import Tracker, TrackerRun

ENDED = {"finished": "STATUS_SUCCESS"}  # a session's end in the HPARAMS tab; anything else: STATUS_FAILURE


class TensorBoardTracker(Tracker):
    config_schema = TensorBoardSettings
    requires = "forge-tokens[tensorboard]"

    def start(self, run: TrackerRun) -> str | None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter  # needs the tensorboard package

        log_dir = Path(run.settings.log_dir) if run.settings.log_dir else run.folder
        self.writer = EventFileWriter(str(log_dir), max_queue_size=100, flush_secs=30)
        if run.resume_id is None:  # hyperparameters once per tracker run
            for value in _hparams_start(run.params, run.run_name):
                self._write(0, [value])
            self._write(0, [_text("config", "```\n" + json.dumps(run.params, indent=1) + "\n```")])
        return str(log_dir)

    def log(self, step, figures) -> None:
        self._write(step, [_scalar(key, value) for key, value in figures.items()])

    def finish(self, step, totals, status) -> None:
        self._write(step, [_scalar(f"final/{key}", value) for key, value in totals.items()])
        self._write(step, [_text("final/status", status)])
        self._write(step, [_hparams_end(status)])  # the HPARAMS tab's session: its last end counts
        self.writer.close()

    def _write(self, step: int, values: list) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        summary = summary_pb2.Summary(value=values)
        self.writer.add_event(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))


def _scalar(tag: str, value: float):
    from tensorboard.compat.proto import summary_pb2

    return summary_pb2.Summary.Value(tag=tag, simple_value=float(value))


def _text(tag: str, text: str):
    """A text summary as TensorBoard's text plugin reads it (a string tensor, `<tag>/text_summary`)."""
    from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
    from tensorboard.plugins.text import metadata

    tensor = tensor_pb2.TensorProto(
        dtype=types_pb2.DT_STRING,
        string_val=[text.encode("utf-8")],
        tensor_shape=tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)]),
    )
    meta = metadata.create_summary_metadata(display_name=tag, description="")
    return summary_pb2.Summary.Value(tag=f"{tag}/text_summary", metadata=meta, tensor=tensor)


def _hparams_start(params: dict, group: str) -> list:
    """The HPARAMS tab's experiment (each parameter's name and type) and this session's values,
    one summary value each (the hparams plugin's protocol buffers and its metadata helper)."""
    from google.protobuf import struct_pb2
    from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

    infos, values = [], {}
    for key, value in params.items():
        if isinstance(value, bool):
            kind, values[key] = api_pb2.DATA_TYPE_BOOL, struct_pb2.Value(bool_value=value)
        elif isinstance(value, (int, float)):
            kind, values[key] = api_pb2.DATA_TYPE_FLOAT64, struct_pb2.Value(number_value=float(value))
        else:
            kind, values[key] = api_pb2.DATA_TYPE_STRING, struct_pb2.Value(string_value=str(value))
        infos.append(api_pb2.HParamInfo(name=key, type=kind))
    start = plugin_data_pb2.SessionStartInfo(hparams=values, group_name=group, start_time_secs=time.time())
    return [
        _hparams_value(
            "EXPERIMENT_TAG", plugin_data_pb2.HParamsPluginData(experiment=api_pb2.Experiment(hparam_infos=infos))
        ),
        _hparams_value("SESSION_START_INFO_TAG", plugin_data_pb2.HParamsPluginData(session_start_info=start)),
    ]


def _hparams_end(status: str):
    from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

    end = plugin_data_pb2.SessionEndInfo(
        status=getattr(api_pb2, ENDED.get(status, "STATUS_FAILURE")), end_time_secs=time.time()
    )
    return _hparams_value("SESSION_END_INFO_TAG", plugin_data_pb2.HParamsPluginData(session_end_info=end))


def _hparams_value(tag: str, data):
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.plugins.hparams import metadata

    data.version = metadata.PLUGIN_DATA_VERSION
    return summary_pb2.Summary.Value(tag=getattr(metadata, tag), metadata=metadata.create_summary_metadata(data))
