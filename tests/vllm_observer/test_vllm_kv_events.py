"""The KV-event decoder and block index against vLLM's own publisher and structs, in the side venv.

No server: vLLM's ``ZmqEventPublisher`` sends real ``KVEventBatch`` messages over loopback, and the
observer's subscriber (which imports neither vLLM nor torch) must decode and index them.
"""

from __future__ import annotations

import subprocess
import textwrap

from vllm_server import ROOT, VENV, free_port, require_vllm

SCRIPT = textwrap.dedent('''
    import sys
    import sparseety.integrations.vllm as pkg
    import sparseety.integrations.vllm.observe.observer, sparseety.integrations.vllm.plugin
    heavy = [m for m in ("torch", "transformers", "vllm") if m in sys.modules]
    assert not heavy, f"the observer's import path imported {heavy}"

    from sparseety.integrations.vllm.observe.kv_events import (
        BlockIndex, KVEventSubscriber, subscriber_endpoint, wait_for)
    from vllm.distributed.kv_events import (
        AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher)

    port = int(sys.argv[1])
    endpoint = f"tcp://127.0.0.1:{port}"
    address, bind = subscriber_endpoint(endpoint)
    assert bind and address == endpoint  # vLLM connects to a non-wildcard endpoint: we bind it
    assert subscriber_endpoint("tcp://*:5557") == ("tcp://127.0.0.1:5557", False)
    index = BlockIndex()
    sub = KVEventSubscriber(address, index, bind=bind).start()
    pub = ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint)

    prompt = list(range(1000, 1100))  # 3 full blocks of 32, 4 tokens left over
    h = [b"\\x01" * 32, b"\\x02" * 32, b"\\x03" * 32]
    first = BlockStored(block_hashes=h[:2], parent_block_hash=None, token_ids=prompt[:64], block_size=32,
                        lora_id=None, medium="CPU", lora_name=None)
    second = BlockStored(block_hashes=[h[2]], parent_block_hash=h[1], token_ids=prompt[64:96], block_size=32,
                         lora_id=None, medium="CPU", lora_name=None)
    other = BlockStored(block_hashes=[12345], parent_block_hash=None, token_ids=list(range(32)), block_size=32,
                        lora_id=None, medium="CPU", lora_name=None)
    # the SUB socket joins asynchronously: publish a marker until it arrives, then the real stream
    for _ in range(100):
        pub.publish(KVEventBatch(ts=1.0, events=[]))
        if wait_for(lambda: sub.batches > 0, 0.1):
            break
    assert sub.batches > 0, "the subscriber never received vLLM's messages"
    base = sub.batches
    pub.publish(KVEventBatch(ts=2.0, events=[first, other]))
    pub.publish(KVEventBatch(ts=3.0, events=[second]))
    assert wait_for(lambda: sub.batches == base + 2, 5)
    blocks = index.prompt_blocks(prompt, 32)
    assert [b.block_hash for b in blocks] == h and [b.depth for b in blocks] == [0, 1, 2]
    assert [list(b.token_ids) for b in blocks] == [prompt[:32], prompt[32:64], prompt[64:96]]
    assert index.prompt_blocks(prompt[:31] + [7] + prompt[32:], 32) == []  # chain broken at block 0
    index.mark_used(blocks, "req-1")
    stored = sub.take()
    assert [c.kind for c in stored] == ["stored"] * 4 and stored[-1].block.first_position == 64

    pub.publish(KVEventBatch(ts=4.0, events=[BlockRemoved(block_hashes=[h[2], b"\\x09" * 32], medium="CPU")]))
    assert wait_for(lambda: sub.batches == base + 3, 5)
    removed = sub.take()
    assert [(c.kind, c.block.block_hash, c.block.requests) for c in removed] == [("removed", h[2], ["req-1"])]
    assert index.removed_unknown == 1  # the second hash was never stored
    assert [b.block_hash for b in index.prompt_blocks(prompt, 32)] == h[:2]

    pub.publish(KVEventBatch(ts=5.0, events=[AllBlocksCleared()]))
    assert wait_for(lambda: sub.batches == base + 4, 5)
    cleared = sub.take()
    assert sorted(str(c.block.block_hash) for c in cleared) == sorted(str(x) for x in [h[0], h[1], 12345])
    assert not index.blocks and index.cleared == 1
    assert sub.decode_errors == 0 and sub.seq_gaps == 0 and sub.dropped_changes == 0
    pub.shutdown()
    sub.stop()
    print("ok")
''')


def test_subscriber_decodes_and_indexes_vllms_own_publisher():
    require_vllm()
    out = subprocess.run([str(VENV / "bin" / "python"), "-c", SCRIPT, str(free_port())], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-3000:] + out.stderr[-3000:]
