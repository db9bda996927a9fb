from prune.run import main

main()
