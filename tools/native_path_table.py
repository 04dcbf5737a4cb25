"""What vllm_compat's check of vLLM's own extract_hidden_states path says on the installed
vLLM, for a Llama, a DeepSeek-V3 (MLA) and a Kimi-K2.5-shaped (MLA, multimodal wrapper)
target: one JSON line, the row of the per-release table in docs/speculators-05-09.md.

Runs on the CPU (configs only, no weights): vLLM's own KV-cache grouping and its connector's
group lookup (vllm_compat.runtime.native_probe), then whether ``backend="native"`` is allowed.

    python tools/native_path_table.py            # in an env with the vLLM release installed
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def targets(root: Path) -> dict[str, str]:
    from vllm_compat.testing.kimi_k25 import KimiK25Shape, kimi_k25_config
    from vllm_compat.testing.models import model_config

    out = {}
    for name, shape, arch in (("llama", "llama-tiny", "LlamaForCausalLM"),
                              ("deepseek_v3", "deepseek_v3", "DeepseekV3ForCausalLM")):
        d = root / name
        cfg = model_config(shape)
        cfg.architectures = [arch]
        cfg.save_pretrained(str(d))
        out[name] = str(d)
    d = root / "kimi_k25"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(kimi_k25_config(KimiK25Shape())))
    out["kimi_k25"] = str(d)
    return out


def row() -> dict:
    import vllm

    from vllm_compat.extract.layers import eagle3_default_layers
    from vllm_compat.runtime import capture_plan
    from vllm_compat.runtime.native_probe import native_path_check
    from vllm_compat.target import read_target

    res: dict = {"vllm": vllm.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in targets(Path(tmp)).items():
            t = read_target(path)
            # EAGLE-3's aux ids (duplicates dropped for the 4-layer DeepSeek-V3)
            ids = list(eagle3_default_layers(t.num_hidden_layers, include_final=False))
            check = native_path_check(t, ids)
            try:
                plan = capture_plan.plan(t, ids, backend="native", enforce_eager=True)
                allowed, why = plan.mode == "native", ""
            except (ValueError, Exception) as exc:  # noqa: BLE001 - the refusal is the row
                allowed, why = False, f"{type(exc).__name__}: {exc}"
            res[name] = {"check": check.ok, "reason": check.reason, "groups": list(check.groups),
                         "native_allowed": allowed, "refusal": why}
    return res


if __name__ == "__main__":
    print(json.dumps(row()))
    sys.stdout.flush()
