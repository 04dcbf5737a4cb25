"""Quick start: drive vLLM's real scheduler through vllm_compat, on any supported release.

Runs on CPU (no model is executed: the sampled tokens are fabricated, as vLLM's own
scheduler tests do). Shows the three things that break fork code across releases:
the block hasher (and init_none_hash), the Request constructor, and the step API.
"""

import vllm_compat as vc

info = vc.detect()
print(f"vLLM {info.version} -> adapter {info.era}")

config = vc.make_vllm_config(block_size=16, enable_prefix_caching=True, num_gpu_blocks=64)
scheduler = vc.make_scheduler(config)
hasher = vc.block_hasher_for(scheduler)  # init_none_hash done, engine's hash block size

prompt = list(range(100, 162))  # 3 full blocks + 14 tokens
for request_id in ("first", "second"):
    scheduler.add_request(vc.make_request(request_id, prompt, block_hasher=hasher))
    while scheduler.has_unfinished_requests():
        out = vc.schedule(scheduler)
        for new in out.scheduled_new_reqs:
            print(f"{new.req_id}: {new.num_computed_tokens} prompt tokens served from the prefix cache")
        ids = list(out.num_scheduled_tokens)
        step = vc.make_model_runner_output(ids, [[7] for _ in ids])  # the model's stand-in
        vc.update_from_output(scheduler, out, step)
print("free KV blocks after both finished:", scheduler.kv_cache_manager.block_pool.get_num_free_blocks())
