"""The BPF dataplane: loading, policy maps, HTB, status, and test runs.

Heavy imports (bcc, pyroute2) happen in the submodules that need them."""
