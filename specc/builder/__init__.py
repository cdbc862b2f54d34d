"""`specc build`: the stages, the plan they share, the files they write and the manifest.

    spec, options --pipeline.py: load -> resolve--> ResolvedSpec (serving.precision: the build's precision)
        --manifest.py--> inputs and cache key --> a cache hit returns DIR's manifest
        --plan.py--> BuildPlan: each graph's stitch, the memory estimates (memory.py) checked,
                     streamed or not, the length verified
        --pipeline.py: build module -> export -> optimize -> save -> verify (against torch)
        --write.py: engines, the target's layout and extras (clients.py: the clients' files)
        --manifest.py--> manifest.json; the staging directory becomes DIR

The public entry is specc.build (specc/__init__.py), which calls pipeline.build.
"""
