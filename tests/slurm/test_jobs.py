"""Reading ``scontrol show job -o``'s one line."""

from __future__ import annotations

from ddpguide.slurm.jobs import parse_show_job

LINE = ("JobId=2 JobName=ddp_torchrun UserId=root(0) GroupId=root(0) Priority=1 "
        "JobState=PENDING Reason=BeginTime Dependency=(null) Requeue=1 Restarts=1 BatchFlag=1 "
        "ExitCode=0:0 NodeList=node[0-1] TRES=cpu=4,node=2,billing=4 "
        "Command=/work/cluster/slurm_torchrun.sbatch --epochs 3 --report report.json "
        "WorkDir=/tmp/a b StdOut=/tmp/a b/job.out\n")


def test_every_field_is_read_and_values_with_spaces_stay_whole():
    fields = parse_show_job(LINE)
    assert (fields["JobState"], fields["Reason"], fields["Restarts"]) == ("PENDING", "BeginTime", "1")
    assert fields["NodeList"] == "node[0-1]" and fields["TRES"] == "cpu=4,node=2,billing=4"
    assert fields["Command"] == "/work/cluster/slurm_torchrun.sbatch --epochs 3 --report report.json"
    assert (fields["WorkDir"], fields["StdOut"]) == ("/tmp/a b", "/tmp/a b/job.out")
    assert parse_show_job("") == {}
