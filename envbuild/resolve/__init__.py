"""From a user's request (or a researcher's project) to one pinned, valid stack."""
