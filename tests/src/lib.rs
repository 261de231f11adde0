//! Home of the driver simulator (`fakecuda/`), the test workloads
//! (`workload/`) and the integration tests that run several real binaries
//! together. Empty until the simulator issue; the scheduler's own
//! integration tests live in `scheduler/tests/`.
