"""`pdmesh certs` and `pdmesh keys`: what a TLS mesh with tenant API keys needs.

pdmesh certs --out certs [--hosts mesh.example.com,10.0.0.5] [--worker decode/decode-0]
    ca.pem (+ ca-key.pem) and <role>.pem / <role>-key.pem for router, decode,
    prefill, kvtransfer, gateway and client (pdmesh/certs.py says what is in them).
pdmesh keys add TENANT --file api-keys.jsonl [--max-priority N] [--requests-per-s R] [--admin] ...
    prints a new key once and appends only its SHA-256 to the file the router
    reads (--api-keys-file); the router picks it up without a restart.
pdmesh keys hash KEY
    the hash of an existing key, for `--api-keys <hash>:<tenant>`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdmesh.cli import command


def _certs_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="folder to write ca.pem and the role certificates to")
    p.add_argument("--hosts", default="", help="extra DNS names / IPs for every certificate, comma-separated")
    p.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="ROLE/WORKER_ID",
        help="also a per-worker certificate (pdmesh://ROLE/WORKER_ID), repeatable",
    )
    p.add_argument("--days", type=int, default=365, help="validity in days")
    p.add_argument(
        "--new-ca", action="store_true", help="replace an existing CA in --out (else it is reused)"
    )


@command("certs", _certs_args)
def certs(args: argparse.Namespace) -> int:
    """Write a dev CA and per-role TLS certificates (server + client use, pdmesh:// role SANs)."""
    from pdmesh.certs import ROLES, write_mesh_certs

    workers = []
    for spec in args.worker:
        role, sep, worker = spec.partition("/")
        if not sep or role not in ROLES or not worker:
            print(
                f"pdmesh certs: --worker {spec!r}: expected ROLE/WORKER_ID with ROLE in {ROLES}",
                file=sys.stderr,
            )
            return 2
        workers.append((role, worker))
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    out = Path(args.out)
    issued = write_mesh_certs(out, hosts=hosts, workers=workers, days=args.days, keep_ca=not args.new_ca)
    print(f"CA: {out / 'ca.pem'} (its key, ca-key.pem, signs more; keep it private)")
    for name, files in issued.items():
        print(f"  {name:<20} {files.cert_file}  {files.key_file}")
    print(
        "Use: PDMESH_TLS_CERT_FILE=<role>.pem PDMESH_TLS_KEY_FILE=<role>-key.pem "
        "PDMESH_TLS_CA_FILE=ca.pem [PDMESH_TLS_REQUIRE_CLIENT_CERT=1]"
    )
    return 0


def _keys_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="keys_command", required=True)
    add = sub.add_parser("add", help="make a key for TENANT; print it once, append its hash to --file")
    add.add_argument("tenant")
    add.add_argument("--file", required=True, help="the router's --api-keys-file (created 0600)")
    add.add_argument("--max-priority", type=int, default=None, help="cap of the requests' priority")
    add.add_argument("--requests-per-s", type=float, default=None)
    add.add_argument("--request-burst", type=float, default=None)
    add.add_argument("--tokens-per-s", type=float, default=None)
    add.add_argument("--token-burst", type=float, default=None)
    add.add_argument("--max-inflight", type=int, default=None, help="open requests of the tenant")
    add.add_argument("--note", default=None, help="free text kept with the hash (who, what for)")
    add.add_argument(
        "--admin", action="store_true", default=None, help="an operator's key: may also call ListWorkers"
    )
    hash_ = sub.add_parser("hash", help="print the SHA-256 of KEY (for --api-keys HASH:TENANT)")
    hash_.add_argument("key")


@command("keys", _keys_args)
def keys(args: argparse.Namespace) -> int:
    """Manage tenant API keys: `keys add TENANT --file F`, `keys hash KEY`."""
    from services.common.api_keys import append_entry, hash_key, new_key

    if args.keys_command == "hash":
        print(hash_key(args.key))
        return 0
    key = new_key()
    fields = {
        f: getattr(args, f)
        for f in (
            "max_priority",
            "requests_per_s",
            "request_burst",
            "tokens_per_s",
            "token_burst",
            "max_inflight",
            "admin",
        )
    }
    try:
        append_entry(args.file, args.tenant, key, note=args.note, **fields)
    except (ValueError, TypeError) as e:
        print(f"pdmesh keys add: {e}", file=sys.stderr)
        return 2
    print(key)
    print(
        f"(tenant {args.tenant!r}; only its hash was written to {args.file}; this key is not shown again)",
        file=sys.stderr,
    )
    return 0
