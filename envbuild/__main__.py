from envbuild.console import main

main()
