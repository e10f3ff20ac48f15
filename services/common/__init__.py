"""What every pagedserve process shares: gRPC plumbing, error mapping and logging."""
