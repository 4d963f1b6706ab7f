"""The SQLite ledger (SQLiteLedger in ledger.py): one file in WAL mode, every write through one writer thread that
group-commits (writer.py); the request path, the keys and the console reads in a module each
(ledger.py, keys.py, usage.py, console.py), over the rules both backends share
(proxy/ledger/commit_rules.py, key_rules.py, rollup.py)."""
