#!/usr/bin/env bash
# `make demo`: not implemented yet; it arrives with the node agent service.
echo "make demo is not there yet: the local demo arrives with the node agent service." >&2
exit 2
