"""The live page of the KV cache: `GET /` (a chat box beside the page pool
drawn as a grid) and `GET /v1/kv_map` (the pool's state as JSON, read by the
engine thread between two steps). Both are served only when the server is
started with `enable_kv_map` (`--enable-kv-map`): the map shows every
running request's length and timing to whoever reads it. With an API key
the page's own fetches send the key typed into its key box.

Each page is one code in `pages`: -1 the trash page (page 0), -2 free, -3
cached but held by nobody (a prefix-cache page, evicted least recently used
first), -4 held by several requests (a shared prefix, or the pages of n
answers), k >= 0 held by request k of `requests` alone. `released` counts
block-table entries given back by a sliding window.

With a host tier (`kv_offload_memory`) `tiers.host` draws it too: one code
per page it holds, least recently used first (pages evicted together, a
prefix, sit side by side): 1 held, 2 on its way from the device, 3 pinned
(a prompt's load back to the device is queued); `tiers.disk` counts the
disk tier's pages and bytes.
"""

from __future__ import annotations

from jaxkv.core.scheduling.page_pool import TRASH_PAGE

TRASH, FREE, CACHED, SHARED = -1, -2, -3, -4


def snapshot(engine) -> dict:
    """The pool's state now (engine thread only)."""
    bm, sched = engine.bm, engine.scheduler
    pages = [FREE] * bm.num_pages
    pages[TRASH_PAGE] = TRASH
    for p in bm.evictable_pages():
        pages[p] = CACHED
    requests, released = [], 0
    for seq in list(sched.running):
        rid = seq.request_id
        if rid not in bm:
            continue
        k = len(requests)
        table = bm.block_table(rid)
        for p in table:
            if p == TRASH_PAGE:
                released += 1
                continue
            pages[p] = SHARED if bm.refcount(p) > 1 else k
        parent = seq.parent.request_id
        label = str(parent)[-8:]
        if seq.index:
            label += f" #{seq.index}"
        requests.append(
            {
                "id": label,
                "pages": sum(1 for p in table if p != TRASH_PAGE),
                "tokens": seq.num_tokens,
                "computed": bm.num_computed_tokens(rid),
            }
        )
    return {
        "num_pages": bm.num_pages,
        "page_size": bm.page_size,
        "pages": pages,
        "requests": requests,
        "waiting": len(sched.waiting),
        "released": released,
        "free": pages.count(FREE),
        "cached": pages.count(CACHED),
        "shared": pages.count(SHARED),
        "tiers": _tiers(getattr(engine, "tier", None)),
    }


def _tiers(tier) -> dict | None:
    if tier is None:
        return None
    codes = [3 if tier.pinned(h) else 1 if tier.ready(h) else 2 for h in tier.hashes()]
    disk = tier.disk
    return {
        "host": {"capacity": tier.capacity, "pages": codes, "bytes": tier.nbytes},
        "disk": (
            {"pages": len(disk), "bytes": disk.nbytes, "max_bytes": disk.max_bytes}
            if disk is not None
            else None
        ),
    }


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>jaxkv: the KV cache, live</title>
<style>
 body { font: 14px system-ui, sans-serif; margin: 16px; display: flex; gap: 24px; }
 #chat { width: 360px; flex: none; }
 #chat textarea { width: 100%; height: 70px; }
 #answer { white-space: pre-wrap; border: 1px solid #ccc; min-height: 160px; padding: 6px; }
 #grid, .grid { display: grid; grid-template-columns: repeat(auto-fill, 9px); gap: 1px;
         max-width: 900px; }
 #grid div, .grid div { width: 9px; height: 9px; }
 .host { background: #7cb342; } .moving { background: #ffb300; } .pinned { background: #6a1b9a; }
 .free { background: #e8e8e8; } .cached { background: #9cc9f0; } .trash { background: #222; }
 .shared { background: repeating-linear-gradient(45deg, #c2185b 0 2px, #f8bbd0 2px 4px); }
 .legend span { display: inline-block; width: 10px; height: 10px; margin: 0 4px 0 10px; }
 #requests li { list-style: none; }
</style></head>
<body>
<div id="chat">
 <h3>Chat</h3>
 <input id="key" type="password" placeholder="API key (if the server asks one)">
 <textarea id="prompt">What is a KV cache?</textarea>
 <button id="send">Send</button>
 <div id="answer"></div>
</div>
<div>
 <h3>Page pool <small id="summary"></small></h3>
 <div class="legend"><span class="free"></span>free<span class="cached"></span>cached, unheld
  <span class="shared"></span>shared<span class="trash"></span>trash page</div>
 <ul id="requests"></ul>
 <div id="grid"></div>
 <div id="tiers" hidden><h3>Host tier <small id="tier_summary"></small></h3>
  <div class="legend"><span class="host"></span>held<span class="moving"></span>on its way
   <span class="pinned"></span>loading back</div>
  <div id="host_grid" class="grid"></div></div>
</div>
<script>
const color = k => `hsl(${(k * 137) % 360}, 65%, 50%)`;
const cls = {"-1": "trash", "-2": "free", "-3": "cached", "-4": "shared"};
const auth = () => {
  const k = document.getElementById("key").value;
  return k ? {Authorization: "Bearer " + k} : {};
};
async function refresh() {
  try {
    const m = await (await fetch("/v1/kv_map", {headers: auth()})).json();
    const grid = document.getElementById("grid");
    while (grid.children.length < m.pages.length) grid.appendChild(document.createElement("div"));
    m.pages.forEach((code, p) => {
      const d = grid.children[p];
      if (code >= 0) { d.className = "req"; d.dataset.req = code; d.style.background = color(code); }
      else { d.className = cls[code]; d.removeAttribute("data-req"); d.style.background = ""; }
    });
    document.getElementById("summary").textContent =
      `${m.num_pages} pages x ${m.page_size} tokens: ${m.free} free, ${m.cached} cached, ` +
      `${m.shared} shared, ${m.requests.length} running, ${m.waiting} waiting`;
    document.getElementById("requests").innerHTML = m.requests.map((r, k) =>
      `<li class="request" data-id="${r.id}"><span style="display:inline-block;width:10px;` +
      `height:10px;background:${color(k)}"></span> ${r.id}: ${r.pages} pages, ` +
      `${r.tokens} tokens</li>`).join("");
    const t = m.tiers, box = document.getElementById("tiers");
    box.hidden = !t;
    if (t) {
      const hg = document.getElementById("host_grid"), hc = ["", "host", "moving", "pinned"];
      const n = Math.min(t.host.capacity, 4096);
      while (hg.children.length < n) hg.appendChild(document.createElement("div"));
      for (let i = 0; i < n; i++) hg.children[i].className = hc[t.host.pages[i] || 0] || "free";
      document.getElementById("tier_summary").textContent =
        `${t.host.pages.length} of ${t.host.capacity} pages, ${(t.host.bytes / 2**20).toFixed(1)} MiB` +
        (t.disk ? `; disk ${t.disk.pages} pages, ${(t.disk.bytes / 2**20).toFixed(1)} MiB` : "");
    }
  } catch (e) { /* the server may be restarting */ }
}
setInterval(refresh, 500); refresh();
document.getElementById("send").onclick = async () => {
  const out = document.getElementById("answer"); out.textContent = "";
  const resp = await fetch("/v1/chat/completions", {method: "POST",
    headers: {"Content-Type": "application/json", ...auth()},
    body: JSON.stringify({messages: [{role: "user",
      content: document.getElementById("prompt").value}], stream: true, max_tokens: 256})});
  const reader = resp.body.getReader(); const dec = new TextDecoder(); let buf = "";
  for (;;) {
    const {value, done} = await reader.read(); if (done) break;
    buf += dec.decode(value, {stream: true});
    const events = buf.split("\\n\\n"); buf = events.pop();
    for (const ev of events) {
      const data = ev.replace(/^data: /, "");
      if (data === "[DONE]") return;
      const c = JSON.parse(data).choices;
      if (c && c.length && c[0].delta.content) out.textContent += c[0].delta.content;
    }
  }
};
</script></body></html>
"""
