"""Is this Python stack inside TRL's weight sync to its generation engine (vLLM)?

Before each generation GRPO/RLOO/Online DPO push the policy's weights to vLLM: in server mode an HTTP
request to the server plus an NCCL broadcast to its workers, neither with a timeout (trl#6796), so a
server that died, hangs, or cannot join the weight-transfer group leaves the trainer waiting forever.
The stall heartbeat reads the training thread's stack; this names the sync frame it waits in.
No import of TRL: frames are matched by file and function name.
"""
from __future__ import annotations

from types import FrameType

# (a path fragment of TRL, the functions that move weights to the engine). Older TRL kept the client in
# trl/extras/ and the sync in the trainers (_move_model_to_vllm); AsyncGRPO has its own transfer client.
WEIGHT_SYNC_FRAMES = (
    ("/trl/generation/vllm_client.py", ("init_communicator", "weight_update", "_start_weight_update",
                                        "_finish_weight_update", "update_named_param", "update_named_params",
                                        "update_model_params")),
    ("/trl/extras/vllm_client.py", ("init_communicator", "update_named_param", "update_model_params")),
    ("/trl/generation/vllm_generation.py", ("sync_weights",)),
    ("/trl/trainer/", ("_move_model_to_vllm", "_sync_fsdp_params_to_vllm", "_sync_fsdp1_params_to_vllm",
                       "_sync_fsdp2_params_to_vllm")),
    ("/trl/experimental/", ("send_weights", "init_weight_transfer", "sync_weights", "_sync_weights")),
)


def _is_sync(path: str, name: str) -> bool:
    return any(fragment in path and name in names for fragment, names in WEIGHT_SYNC_FRAMES)


def weight_sync_frames(frame: FrameType | None) -> list[FrameType]:
    """The weight-sync frames on this stack, outermost first (empty when it is not syncing)."""
    found: list[FrameType] = []
    while frame is not None:
        if _is_sync(frame.f_code.co_filename.replace("\\", "/"), frame.f_code.co_name):
            found.append(frame)
        frame = frame.f_back
    return found[::-1]


def describe(frame: FrameType) -> str:
    """``update_named_params (trl/generation/vllm_client.py:845)``: the path from ``trl/`` on."""
    path = frame.f_code.co_filename.replace("\\", "/")
    short = path[path.rfind("/trl/") + 1:] if "/trl/" in path else path
    return f"{frame.f_code.co_name} ({short}:{frame.f_lineno})"
