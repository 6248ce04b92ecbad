"""Images, made and examined: the build, the smoke verdict, the enroot .sqsh, the compiled-extension cache, what an image holds and how two differ, rebuild from an image's record, base digests."""
