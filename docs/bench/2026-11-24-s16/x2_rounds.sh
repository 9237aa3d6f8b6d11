#!/usr/bin/env bash
# Session 16's rounds A-F, superseded by session 17's script (the same rounds, the op tables
# over separate weights and graph-replayed, and a round G): run that one.
exec bash "$(dirname "$0")/../2026-11-25-s17/x2_rounds.sh" "$@"
