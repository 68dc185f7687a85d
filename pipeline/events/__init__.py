"""Event logs (users' actions on items) -> user histories: the event spec, the Beam job
and its parts, statistics, follow mode over new event files, the spec proposal and the
synthetic event generator. Click logs are the package above (`pipeline.click_job`)."""
