"""The PostgreSQL ledger: PostgresLedger in ledger.py (asyncpg is imported by it alone, so the
keys CLI and the spool tools load without it). Row locks per key, every replica on one
database. The keys (keys.py), the usage rows (usage.py), the console reads (console.py), the
local spool (spool.py), the fault state and its probe (faults.py, errors.py), the key-change
listener (listen.py) and the migrations (schema.py), over the rules both backends share
(proxy/ledger/commit_rules.py, key_rules.py, rollup.py)."""
