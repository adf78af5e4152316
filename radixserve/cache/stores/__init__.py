"""What the prefix cache keeps beside its tree: stores, each holding one kind of payload per node.

The tree (`radixserve.cache.tree`) is the shape: nodes, namespaces, locks, splits, eviction order.
A store is one kind of thing a node can hold, in the node field the store names:

| store | field | payload | usable for |
|---|---|---|---|
| `device_kv.DeviceKV` | `value` | device KV slots | reading now (unless a load still fills them) |
| `host_kv.HostKV` | `host` | a host copy of the KV (`HostCopy`) | loading back to the device |
| `snapshots.SnapshotStore` | `state` | a recurrent-state snapshot (`Snapshot`) | resuming a hybrid model's request at the node's end |

A node keeps one payload per store (None: that store holds nothing of it); a tier is a field, not
a subclass. `RadixCache` (radix_cache.py) is the one cache class: a tree plus the stores there
are, chosen by `factory.tree_cache`.

Each store answers, through the hooks of `tree.Store`, what happens to its payload when the tree changes:

- `on_split(upper, lower, n)`: a node is cut after n tokens; per-token payloads are cut with it,
  a payload at the node's end stays with the lower part.
- `on_remove(node)` / `after_remove(node, parent)`: the node leaves the tree (it is a leaf);
  the store frees what it held (the device store goes last); afterwards the parent may have
  become evictable for the store's own pool.
- `on_flush(node)`: the whole tree is dropped; free what the node holds. `reset()` follows.
- `eviction_rank(node)` (when `ranks_eviction`): what the store adds to a device leaf's eviction
  priority, between queue-awareness and the eviction policy (the snapshot store: leaves with no
  snapshot go first).
- `leaves_device(node)`: the device evicts the node's KV while the node stays (a lower tier
  keeps it); a store whose payload needs the device moves it down or drops it.
- `check(...)`, `reset_counters()`: invariants and counters.

A store under the host tier (a disk tier keyed by the chained page hashes `block_hash.page_hashes`
over the namespace's `namespace.namespace_page_parent`, the same hashes the KV events publish) is
one more store: its payload in one more node field, the hooks above, and a place in the chain of
tiers the host store already walks (`HostKV.evict_device` spills device leaves into the host;
`HostKV._host_slots` is where host copies are dropped to make room: the place to spill them one
tier lower; `HostKV.load` is where a match's lower-tier part is brought back, `host_part` what a
waiting request's lookup counts as not ready).
"""
