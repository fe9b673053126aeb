#!/usr/bin/env bash
# How these results were made: bench/before_after.sh with the session's base c91f743 checked out in
# /tmp/cv-before (that tree ran its own conveyor.cli.bench) and the session's end in /tmp/cv-after.
BEFORE=/tmp/cv-before AFTER=/tmp/cv-after OUT=${OUT:-/tmp/bench-ab} exec "$(dirname "$0")/../../before_after.sh"
